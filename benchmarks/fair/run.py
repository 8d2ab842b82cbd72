"""A comparison from start to end, whatever the engine: the driver starts both configurations' engines and makes
the trace; :func:`.method.compare` runs the schedule; on the saturated shape a driver that can (``alone``) then
runs the limit of sharing, one plain engine given the whole budget; the report is rewritten after every run,
printed at the end, and drawn. Engines are stopped on Ctrl-C (exit 130) and on failure (exit 1): an engine that
dies or a run with a request unanswered ends the comparison at once, with one line on stderr."""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from . import report as rep
from .method import Clock, Side, compare, compare_alone


class Driver(Protocol):
    """One engine's way of running both configurations."""

    title: str  # the report's title: which engine
    device: str

    def start(self) -> dict[str, Side]:
        """Both configurations' engines, up (every one answers)."""
        ...

    def trace(self) -> list[dict]:
        """The trace every run replays (after :meth:`start`: a driver may calibrate on its engines)."""
        ...

    def describe(self) -> dict:
        """The report's fields this driver knows: ``machine``, ``models``, ``share_bytes``, ``setup_lines``
        (markdown), ``counters_note``, ``timeout_s`` (one run's answers), and any of its own."""
        ...

    def stop(self, failed: bool = False) -> None:
        """Stop every engine (also those half started); called once, whatever happened. ``failed``: the comparison
        did not end (a driver keeps what explains it, such as the engines' logs)."""
        ...


def run(driver: Driver, *, pairs: int, seed: int, shape: str, single: bool, command: str,
        stem: Path | None, time_limit_s: float | None = None) -> int:
    """Run the comparison; write ``stem``.json/.md/.png (none when ``stem`` is None). 0 when every request of every
    run was answered, 1 otherwise or on failure, 130 on Ctrl-C. ``time_limit_s``: from the command's start, no pair
    starts that would not end within it (judged by the longest run so far); the report says what was left out."""
    started = time.monotonic()
    clock = Clock(None if time_limit_s is None else started + time_limit_s)
    report: dict = {"title": driver.title, "device": driver.device, "command": command, "shape": shape,
                    "single": single, "seed": seed, "pairs": pairs,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "runs": []}

    def done(one: dict) -> None:
        report["runs"].append(one)
        report.update(rep.ratios(report["runs"]), **rep.preemptions(report["runs"]),
                      **rep.limit_of_sharing(report["runs"]), seconds=round(time.monotonic() - started, 1))
        report.update(getattr(driver, "notes", dict)())
        print(f"run {one['run']} ({one['kind']}) {one['configuration']}: p99 TTFT {one['ttft_p99_s']:.2f} s, "
              f"{one['tokens_per_s']:.1f} tokens/s, TPOT {_n(one.get('tpot_mean_s'))} s, {one['answered']}/{one['requests']} answered, "
              f"{_n(one.get('requests_per_step'))} requests per step, {_len(one.get('preempted'))} preempted; "
              f"{one['elapsed_s']:.1f} s, {report['seconds']:.0f} s since the command started", flush=True)
        if stem is not None:
            rep.save(report, stem)

    failed = True
    try:
        sides = driver.start()
        trace = driver.trace()
        about = driver.describe()
        report.update({k: v for k, v in about.items() if k != "timeout_s"}, trace_requests=len(trace))
        compare(sides, trace, pairs, about["timeout_s"], done, getattr(driver, "around", None),
                in_turn=not getattr(driver, "together", True), clock=clock)
        alone = getattr(driver, "alone", None)
        if shape == "saturated" and not single and alone is not None and \
                clock.fits(pairs + 2, "the runs of one engine alone"):  # its start, its warm-up, its runs
            busy = [row for row in trace if row["model"] == "m0"]
            compare_alone(alone(), busy, pairs, about["timeout_s"], done, first=len(report["runs"]) + 1, clock=clock)
        if clock.stopped:
            print(f"time limit: {clock.stopped}", flush=True)
            report["stopped_early"] = clock.stopped
            if stem is not None:
                rep.save(report, stem)
        failed = False
    except KeyboardInterrupt:
        failed = False  # asked for: nothing to look into
        print("interrupted: every engine was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"multimodel: {exc}", file=sys.stderr)
        return 1
    finally:
        driver.stop(failed)
    if stem is not None and report["runs"]:
        png = rep.plot(report, stem.with_suffix(".png"))
        if png is not None:
            report["picture"] = png.name
            rep.save(report, stem)
    print(rep.markdown(report))
    return 0 if all(r["answered"] == r["requests"] for r in report["runs"]) else 1


def _n(value: Any) -> str:
    """A counter as printed: n/a where the engine keeps none."""
    return rep.NA if value is None else str(value)


def _len(ids: Any) -> str:
    return "n/a" if ids is None else str(len(ids))
