"""``python -m benchmarks multimodel --engine transformers`` on CPU, run as a user runs it (a process, its CLI):
a short trace end to end (static and elastic engines, interleaved repeats, the report's fields), and Ctrl-C while
it runs leaves no engine process and no segment directory behind."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


def _unsupported() -> str | None:
    """Why continuous batching cannot run here (a transformers outside the plugin's range), or None."""
    try:
        from kvcached_transformers.cb.seams import UnsupportedTransformers, check
    except ImportError as exc:
        return str(exc)
    try:
        check()
    except UnsupportedTransformers as exc:
        return str(exc)
    return None


UNSUPPORTED = _unsupported()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(UNSUPPORTED is not None, reason=str(UNSUPPORTED))]


def segment_dirs() -> set[Path]:
    """The benchmark's segment directories that exist now (it makes one per run, under /dev/shm when it can)."""
    return set(SHM.glob("kvc-tcb-*")) if SHM.is_dir() else set()


def default_sigint() -> None:  # a test run in the background inherits SIGINT ignored; the benchmark must see it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bench(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers", "--device", "cpu", "--quick",
         *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)


def still_running(seen: dict[int, float], deadline_s: float = 15.0) -> list[str]:
    """The processes of ``seen`` (pid -> start time) still alive once ``deadline_s`` passed (a child that is
    exiting as it is read gets that long to be gone)."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = []
        for pid, created in seen.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid}: {' '.join(proc.cmdline())[:120]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_a_short_trace_is_answered_by_both_configurations_in_interleaved_repeats(tmp_path: Path) -> None:
    """Two repeats of a 4-second trace: every request answered in every run, the runs interleaved, the report's
    ratios and per-request figures written where --out says."""
    before = segment_dirs()
    proc = bench("--repeats", "2", "--duration", "8", "--out", str(tmp_path))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads((tmp_path / "multimodel-transformers-cpu-quick.json").read_text())
    assert report["command"].endswith("--quick --repeats 2 --duration 8") and report["duration_s"] == 4.0
    assert [r["configuration"] for r in report["runs"]] == ["static", "elastic", "static", "elastic"]
    assert report["trace_requests"] >= 2 and report["engine"] == "transformers" and "seed" in report
    for run in report["runs"]:
        assert run["answered"] == run["requests"] == report["trace_requests"], run["configuration"]
        assert run["tokens"] > 0 and run["tokens_per_s"] > 0
        ttfts = [ttft for _, _, ttft in run["ttft_by_arrival"]]
        assert len(ttfts) == run["requests"] and all(t is not None and t >= 0 for t in ttfts)
        assert run["ttft_p99_s"] <= max(ttfts) + 1e-3
    for key in ("ttft_p99_ratio_median", "ttft_p99_ratio_min", "ttft_p99_ratio_max", "throughput_ratio_median"):
        assert report[key] > 0, key
    assert report["ttft_p99_ratio_min"] <= report["ttft_p99_ratio_median"] <= report["ttft_p99_ratio_max"]
    # the elastic engines' segments were sampled, under one budget shared by the three models
    elastic = [r for r in report["runs"] if r["configuration"] == "elastic"]
    assert all(r["kv_samples"] for r in elastic)
    assert {n for r in elastic for row in r["kv_samples"] for n in row if n != "t"} == {"e0", "e1", "e2"}
    assert (tmp_path / "multimodel-transformers-cpu-quick.md").read_text().count("| elastic |") == 2
    assert "| elastic |" in out  # the table is printed too
    assert segment_dirs() <= before  # its segment directory went with it


def test_ctrl_c_while_it_runs_stops_every_engine_and_removes_its_segments() -> None:
    before = segment_dirs()
    proc = bench("--repeats", "1", "--no-write")
    seen: dict[int, float] = {}
    try:
        # both configurations' engines (three each) are up and the elastic ones have made their segments
        deadline = time.monotonic() + 240
        engines = 0
        while time.monotonic() < deadline:
            engines = 0
            for kid in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    seen.setdefault(kid.pid, kid.create_time())
                    engines += "spawn_main" in " ".join(kid.cmdline())
            made = segment_dirs() - before
            if engines == 6 and any(any(d.iterdir()) for d in made if d.is_dir()):
                break
            time.sleep(0.5)
        assert engines == 6, f"the engines did not start in time: {engines} of 6"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: every engine was stopped" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not still_running(seen)
    assert segment_dirs() <= before, segment_dirs() - before


def test_bad_duration_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers",
                           "--duration", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--duration must be more than 0 seconds" in proc.stderr
    assert "Traceback" not in proc.stderr
