"""The comparison's method (benchmarks/fair/method.py, trace.py): the ABBA order in turn, the time limit on pairs,
the check that every request of a run was answered, and a recorded trace's bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.fair.method import Answer, Clock, schedule, unanswered
from benchmarks.fair.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]


def order(pairs: int, in_turn: bool) -> list[str]:
    return [f"{s.configuration[0]}{s.pair}" for s in schedule(pairs, in_turn=in_turn)]


def test_in_turn_pair_one_goes_on_from_the_elastic_warm_up_and_stays_abba() -> None:
    assert order(2, False) == ["s0", "e0", "s1", "e1", "e2", "s2"]
    assert order(4, True) == ["s0", "e0", "e1", "s1", "s2", "e2", "e3", "s3", "s4", "e4"]

    def switches(runs: list[str]) -> int:
        return sum(a[0] != b[0] for a, b in zip(runs, runs[1:], strict=False))

    assert (switches(order(4, True)), switches(order(4, False))) == (5, 6)  # one engine start saved


def test_the_clock_lets_a_pair_start_only_if_it_fits_what_is_left() -> None:
    clock = Clock(time.monotonic() + 100.0, longest_s=40.0)
    assert clock.fits(2, "pairs 2 to 3") and not clock.stopped  # 80 s of 100
    clock.longest_s = 60.0
    assert not clock.fits(2, "pairs 3 to 3")
    assert clock.stopped.startswith("pairs 3 to 3 left out: 2 runs of up to 60 s each")
    assert not clock.fits(1, "the runs of one engine alone")  # once stopped, nothing more starts
    assert Clock(None, longest_s=1e9).fits(100, "anything")  # no limit


def answer(tokens: int = 3, error: str | None = None, first: float | None = 1.0) -> Answer:
    return Answer(0, 0.0, first, 2.0, tokens, error)


def test_a_run_is_checked_for_every_answer_with_tokens() -> None:
    assert unanswered([answer(), answer()], 2, 60) is None
    assert unanswered([answer()], 2, 60) == "1 of 2 requests answered; 1 with no answer within 60 s"
    assert unanswered([answer(), answer(tokens=0, first=None)], 2, 60) == \
        "1 of 2 requests answered; 1 answered with no token"
    assert unanswered([answer(error="HTTP 500"), answer()], 2, 60) == \
        "1 of 2 requests answered; 1 failed (first: HTTP 500)"


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    return path


def test_a_recorded_trace_is_read_sorted_and_its_bad_rows_named(tmp_path: Path) -> None:
    rows = [{"t": 2.0, "model": "m1", "prompt_tokens": 5, "max_tokens": 2, "seed": 1, "extra": "dropped"},
            {"t": 0.5, "model": "m0", "prompt_tokens": 9, "max_tokens": 1, "seed": 2}]
    assert [r["t"] for r in read_trace(write(tmp_path, {"requests": rows}), 2)] == [0.5, 2.0]
    assert "extra" not in read_trace(write(tmp_path, {"requests": rows}), 2)[1]
    with pytest.raises(ValueError, match=r"request 0 is not \{t >= 0, model in m0..m0,"):
        read_trace(write(tmp_path, {"requests": rows}), 1)  # m1 with one model
    with pytest.raises(ValueError, match="no 'requests' list"):
        read_trace(write(tmp_path, [1, 2]), 1)
    with pytest.raises(ValueError, match="request 1 is not"):
        read_trace(write(tmp_path, {"requests": [rows[1], dict(rows[1], max_tokens=0)]}), 1)


def test_a_bad_trace_file_is_a_usage_error_in_one_line(tmp_path: Path) -> None:
    from test_bench_multimodel_tcb import UNSUPPORTED

    if UNSUPPORTED is not None:
        pytest.skip(UNSUPPORTED)
    bad = tmp_path / "trace.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers", "--trace",
                           str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"multimodel: --trace {bad}: cannot be read as JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))"]


def test_the_benchmark_path_imports_no_textual_and_a_screenshot_without_it_is_a_usage_error() -> None:
    """The GPU hosts run the benchmark without textual: no module of the harness imports it (kvtop's screen, the
    one part that needs it, is imported only for --screenshot), and --screenshot there is refused in one line."""
    code = ("import sys, pkgutil, importlib, importlib.util\n"
            "sys.modules['textual'] = None  # importing it now raises ImportError\n"
            "import benchmarks.fair, benchmarks.multimodel\n"
            "for info in pkgutil.iter_modules(benchmarks.fair.__path__):\n"
            "    importlib.import_module('benchmarks.fair.' + info.name)\n"
            "importlib.util.find_spec = lambda name, *a: None\n"
            "sys.exit(benchmarks.multimodel.main(['--engine', 'transformers', '--screenshot', 'x.svg']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: --screenshot needs textual (kvtop's screen), which is not installed here: leave it out"), proc.stderr
    assert "Traceback" not in proc.stderr
