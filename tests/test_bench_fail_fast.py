"""``python -m benchmarks multimodel --engine transformers`` fails fast: an engine that dies ends the command within
seconds, with the engine's own error line on stderr, every engine stopped and exit 1, instead of waiting out the run's
timeout on answers that cannot come. Real engine processes, made to fail by real bad input: a kvcached setting the
elastic engines refuse when they build their cache, and a recorded trace with a request longer than a static share
holds, which stops transformers' generation loop in the middle of a run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import default_signals
from test_bench_multimodel_tcb import UNSUPPORTED, segment_dirs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(UNSUPPORTED is not None, reason=str(UNSUPPORTED))]
AFTER_DEATH_S = 30.0  # the most an engine's death may take to end the command (issue 49's target)
# The runs' trace lasts 20 s (--quick halves --duration 40), so a run waits 140 s for answers that do not come
# before it gives up (the harness's timeout: 4 x the trace + 60 s); the commands below must end long before.
DURATION = "40"


class Watched:
    """The benchmark as a process, and when each of its engine processes ended."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers", "--device", "cpu",
             "--quick", "--shape", "steady", "--pairs", "1", "--duration", DURATION, "--no-write", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals,
            start_new_session=True, env={**os.environ, **(env or {})})  # its group: its engines go with it
        self.engines: dict[int, float] = {}  # pid -> create time
        self.ended: dict[int, float] = {}  # pid -> when it was first seen gone (time.monotonic)
        self.exited = 0.0

    def watch(self, limit_s: float) -> tuple[str, str]:
        """Follow the engine processes until the benchmark exits (killed after ``limit_s``); its output."""
        deadline = self.started + limit_s
        try:
            while True:
                self._look()
                try:
                    self.proc.wait(timeout=0.2)  # the condition waited on: the benchmark's exit
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:  # the engines too: they hold its output's pipes
                        os.killpg(self.proc.pid, signal.SIGKILL)
                        break
        finally:
            self.exited = time.monotonic()
            out, err = self.proc.communicate()
        return out, err

    def _look(self) -> None:
        now = time.monotonic()
        with contextlib.suppress(psutil.NoSuchProcess):
            for kid in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if "spawn_main" in " ".join(kid.cmdline()):
                        self.engines.setdefault(kid.pid, kid.create_time())
        for pid, created in self.engines.items():
            if pid not in self.ended and not alive(pid, created):
                self.ended[pid] = now

    def left(self) -> list[int]:
        """Engine processes still running."""
        return [pid for pid, created in self.engines.items() if alive(pid, created)]


def alive(pid: int, created: float) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    return False


def ended_in_time(run: Watched, err: str) -> None:
    """Exit 1 within AFTER_DEATH_S of the first engine's end, the last line of stderr the engine's error, no
    traceback, no engine left, no segment directory left, the engines' log kept and named."""
    assert run.proc.returncode == 1, err[-3000:]
    assert run.ended, f"no engine process ended before the benchmark did: {err[-2000:]}"
    after = run.exited - min(run.ended.values())
    assert after <= AFTER_DEATH_S, f"{after:.1f} s from the engine's death to the benchmark's exit"
    assert "Traceback" not in err, err[-3000:]
    assert not run.left(), run.left()
    assert not segment_dirs(run.proc.pid)
    log = Path(err.strip().splitlines()[-1].rsplit("(its log: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.read_text()  # the engine's own output, traceback included, kept for a look
    for path in log.parent.iterdir():
        path.unlink()
    log.parent.rmdir()


def test_elastic_engines_that_cannot_build_their_cache_end_the_command_at_once() -> None:
    """A page size kvcached refuses: every elastic engine's generation loop dies building its cache (as the CUDA
    reserve's refused alignment did on an H100). The command ends before any run, with that refusal as its line."""
    run = Watched("--single", env={"KVCACHED_PAGE_SIZE_MB": "3"})
    _, err = run.watch(limit_s=240)
    last = err.strip().splitlines()[-1]
    assert last.startswith("multimodel: engine e0 died: "), err[-3000:]
    assert "KVCACHED_PAGE_SIZE_MB=3 must be a positive multiple of 2" in last, err[-3000:]
    ended_in_time(run, err)


def test_an_engine_whose_loop_dies_mid_run_ends_the_command_within_seconds(tmp_path: Path) -> None:
    """A recorded trace whose fifth request (2,000 prompt tokens) is longer than a static share holds (6 blocks of
    256 tokens): the static engine answers the four before it, then its generation loop stops with transformers' own
    error when that one comes, in the first run."""
    short = [{"t": 0.5 * i, "model": "m0", "prompt_tokens": 200, "max_tokens": 8, "seed": i} for i in range(4)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"requests": [*short, {"t": 3.0, "model": "m0", "prompt_tokens": 2000,
                                                       "max_tokens": 8, "seed": 9}]}))
    run = Watched("--single", "--trace", str(trace))
    out, err = run.watch(limit_s=240)
    assert f"traffic: the 5 requests of {trace}, as recorded" in out, (out[-2000:], err[-2000:])
    last = err.strip().splitlines()[-1]
    assert re.match(r"multimodel: engine s0(: request static0-4 failed| died): ", last), err[-3000:]
    assert "No requests can be scheduled and no requests can be offloaded." in last, err[-3000:]
    ended_in_time(run, err)
