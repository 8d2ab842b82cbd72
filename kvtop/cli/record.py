"""``kvctl record``: record every model on this host, one sample per interval, to SQLite day files."""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import click

from kvtop.cli import ExitCode, Failure, SizeParamType, SizeSpec
from kvtop.cli.common import warn

_SECONDS = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class Seconds(click.ParamType):
    """``500ms``, ``1s``, ``10m``, ``24h``, ``7d`` or a plain number of seconds, above zero."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        match = _SECONDS.match(str(value).strip().lower())
        seconds = float(match.group(1)) * _UNIT_S[match.group(2) or "s"] if match else 0.0
        if not match or not 0 < seconds < math.inf:
            self.fail(f"{value!r} is not a duration above zero (like 1s, 500ms, 10m, 24h)", param, ctx)
        return seconds


def default_directory() -> Path:
    """``$XDG_STATE_HOME/kvtop/record``, else ``~/.local/state/kvtop/record``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "kvtop" / "record"


@click.command("record")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Directory of the day files (kvrecord-YYYY-MM-DD.sqlite, UTC days); created if missing. "
                   "Default: $XDG_STATE_HOME/kvtop/record (~/.local/state/kvtop/record).")
@click.option("--interval", type=Seconds(), default="1s", show_default=True, help="Time between samples.")
@click.option("--duration", type=Seconds(), default=None, help="Stop after this long (default: until stopped).")
@click.option("--max-size", "max_size", type=SizeParamType(allow_percent=False), default=None, metavar="SIZE",
              help="Drop the oldest day files while the recording is larger (1GiB, 500MB); never today's.")
@click.option("--no-gpus", "no_gpus", is_flag=True, help="Do not ask NVML for the GPUs' memory.")
def record_cmd(out: Path | None, interval: float, duration: float | None, max_size: SizeSpec | None,
               no_gpus: bool) -> None:
    """Record every model on this host: counters, limits, traffic, reclaims, sleep, page maps, events.

    One sample per interval: every model's figures (ours and the public kvcached's rows), the
    page map of each (only the changes since the last sample, a whole map every 60 samples), the
    GPUs and the events kvtop's log shows. Written to one SQLite file per UTC day, which
    kvtop --replay, kvctl report and SQL read (docs/record.md). Ctrl-C (exit 130) or SIGTERM
    (exit 0) stop it after the sample being written is committed; a write that fails (a full
    disk) is one line on stderr and exit 1, with what was written still readable.

    \b
    Examples:
      kvctl record
      kvctl record --out /var/tmp/kv --interval 5s --max-size 1GiB
      kvctl record --duration 10m --out ./incident
    """
    from kvcached_core.settings import shm_dir_problem
    from kvtop.record.recorder import Recorder, RecordWriteError

    directory = out if out is not None else default_directory()
    limit = None if max_size is None else max_size.value
    problem = shm_dir_problem()
    if problem:
        raise Failure(problem)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise Failure(f"{directory}: cannot create the directory: {exc.strerror or exc}") from None
    stop = threading.Event()
    why: list[int] = []

    def stopping(signum: int, _frame: object) -> None:
        why.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: the write fails, and we say so
    recorder = Recorder(directory, interval=interval, max_size=limit, gpus=not no_gpus)
    started = time.monotonic()
    click.echo(f"kvctl record: recording every {interval:g} s to {directory} (Ctrl-C stops)", err=True)
    tick = 0
    try:
        while not stop.is_set():
            recorder.write(recorder.read())
            for path in recorder.dropped:
                warn(f"dropped {path} (--max-size)")
            recorder.dropped.clear()
            tick += 1
            now = time.monotonic()
            if duration is not None and now - started >= duration:
                break
            tick = max(tick, math.ceil((now - started) / interval))  # behind: skip the missed samples
            delay = started + tick * interval - now
            if duration is not None:
                delay = min(delay, started + duration - now)
            if stop.wait(delay):
                break
    except RecordWriteError as exc:
        raise Failure(str(exc)) from None
    finally:
        recorder.close()
    if why and why[0] == signal.SIGINT:
        raise click.exceptions.Exit(ExitCode.INTERRUPTED)
