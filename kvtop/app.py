"""kvtop's command line: the live dashboard, ``--once``, ``--demo`` and ``--replay`` (the app itself:
:mod:`kvtop.screen.dashboard`; a replay's: :mod:`kvtop.replay.app`)."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator, Sequence

import click

from kvcached_core import __version__
from kvtop.cli.common import Number, Whole
from kvtop.frames.source import LiveSource
from kvtop.screen.dashboard import KvtopApp

# -- command line ------------------------------------------------------------------------------

def parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of GPU indices (try 0 or 0,2)", param_hint="--gpu") from None
    if not values or any(v < 0 for v in values):
        raise click.BadParameter(f"{text!r} is not a list of GPU indices (try 0 or 0,2)", param_hint="--gpu")
    return values


@contextlib.contextmanager
def _exit_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP outside the app unwind like Ctrl-C, so ``finally`` blocks still run."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    saved[signal.SIGINT] = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def run_replay(path: str, *, at: str | None, once: bool, gpus: list[int] | None, model: str | None) -> int:
    """``kvtop --replay FILE``: the dashboard over a recording, or (``--once``, no terminal) the moment ``at``.

    A file that is no readable recording is one line and exit 1; an ``--at`` the recording does not hold,
    one line and exit 2."""
    from pathlib import Path

    from kvtop.record.reading import Recording, RecordingError
    from kvtop.replay.app import ReplayApp
    from kvtop.replay.source import ReplayClock, ReplaySource, parse_moment
    from kvtop.screen.once import print_once

    try:
        recording = Recording.open(Path(path))
    except RecordingError as exc:
        click.echo(f"kvtop: {exc}", err=True)
        return 1
    try:
        moment = None
        if at is not None:
            try:
                moment = parse_moment(at, start=recording.start, end=recording.end, now=recording.start)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--at") from None
        if once or not (sys.stdout.isatty() and sys.stdin.isatty()):
            return print_once(ReplaySource(recording, ReplayClock(recording.times(), at=moment)), model=model,
                              gpus=gpus)
        app = ReplayApp(recording, name=path, model=model, gpus=gpus, at=moment)
        app.run()
        return app.return_code or 0
    finally:
        recording.close()


def run(*, demo: bool, demo_models: int, once: bool, interval: float, gpus: list[int] | None,
        model: str | None, readonly: bool) -> int:
    """Start the demo fleet if asked, then the dashboard or the one-shot snapshot; always stop the fleet."""
    from kvtop.screen.once import print_once

    interactive = sys.stdout.isatty() and sys.stdin.isatty()
    fleet = None
    with _exit_on_signals():
        try:
            if demo:
                from kvcached_core.settings import shm_dir_problem
                from kvtop.demo.fleet import DemoFleet

                problem = shm_dir_problem(writable=True)
                if problem:
                    click.echo(f"kvtop: {problem}", err=True)
                    return 1
                fleet = DemoFleet(models=demo_models)
                fleet.start()
                if not fleet.wait_ready(timeout=20):
                    click.echo(f"kvtop: {fleet.failure or 'the demo models did not start'}", err=True)
                    return 1
            source = LiveSource(gpus)
            if once or not interactive:
                if demo:
                    time.sleep(1.0)  # let the demo traffic fill some pages
                return print_once(source, model=model, gpus=gpus)
            app = KvtopApp(source, interval=interval, model=model, gpus=gpus, readonly=readonly)
            app.run()
            return app.return_code or 0
        finally:
            if fleet is not None:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # let the cleanup finish
                    signal.signal(sig, signal.SIG_IGN)
                fleet.stop()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--demo", is_flag=True, help="Start demo models (as `kvctl demo`) and stop them on exit.")
@click.option("--demo-models", type=Whole(1, 6), default=4, show_default=True,
              help="How many demo models --demo starts.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit (automatic when stdout is not a terminal).")
@click.option("--interval", type=Number(0.05, 60), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--gpu", "gpu", metavar="LIST", help="Only these GPU indices, e.g. 0 or 0,2 (panels and models).")
@click.option("--model", metavar="NAME", help="Select this model (exact name or unique prefix).")
@click.option("--readonly", is_flag=True,
              help="Disable every action that changes something (trim, compact, sleep/wake, limit, policy).")
@click.option("--replay", "replay", metavar="FILE",
              help="Replay a recording (kvctl record: a day file or its directory) instead of the live models.")
@click.option("--at", "at", metavar="TIME",
              help="With --replay: start at this moment (HH:MM[:SS], an ISO time, +10m from the start).")
@click.version_option(__version__, prog_name="kvtop")
def cli(demo: bool, demo_models: int, once: bool, interval: float, gpu: str | None, model: str | None,
        readonly: bool, replay: str | None, at: str | None) -> int:
    """Live dashboard of kvcached models: devices, models, page maps, fragmentation; trim and set limits.

    Keys: q quit · ? help · ↑/↓ j/k select · ←/→ pgup/pgdn page map · enter details · t trim · T trim all · l limit · p policy · s sort ·
    f filter · space pause · +/- interval · z/Z zoom · ctrl+p command palette.

    --replay FILE: the same dashboard over a recording of kvctl record (space play/pause, +/- speed, ./, step,
    g go to a moment, n/N next/previous event).
    """
    if replay is not None:
        if demo:
            raise click.UsageError("--replay shows a recording: it cannot go with --demo")
        return run_replay(replay, at=at, once=once, gpus=parse_gpus(gpu), model=model)
    if at is not None:
        raise click.UsageError("--at is a moment of a recording: it goes with --replay FILE")
    return run(demo=demo, demo_models=demo_models, once=once, interval=interval, gpus=parse_gpus(gpu),
               model=model, readonly=readonly)


def main(argv: Sequence[str] | None = None) -> None:
    """Console script: errors are one line on stderr; exit 0 ok, 1 failure, 2 usage, 130 interrupted."""
    try:
        code = cli.main(args=list(argv) if argv is not None else None, prog_name="kvtop", standalone_mode=False)
    except click.UsageError as exc:  # as kvctl says it: one line, then where the options are
        click.echo(f"kvtop: {' '.join(exc.format_message().split())} (see 'kvtop --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"kvtop: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("kvtop: interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()


__all__ = ["cli", "main"]
