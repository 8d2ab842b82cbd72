"""``python -m benchmarks multimodel --engine transformers`` on CPU, run as a user runs it (a process, its CLI):
a short trace end to end with the harness's method (warm-ups, then ABBA pairs; every run and its counters in the
report), and Ctrl-C while it runs leaves no engine process and no segment directory behind."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from procs import default_signals  # a test run in the background inherits SIGINT ignored; the benchmark must see it

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


def segment_dirs(pid: int) -> set[Path]:
    """The segment directories of the benchmark process ``pid`` that exist now (it makes one, named for its pid,
    under /dev/shm when it can; other runs on the host have their own)."""
    return set(SHM.glob(f"kvc-tcb-{pid}-*")) if SHM.is_dir() else set()


def bench(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers", "--device", "cpu", "--quick",
         *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)


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


def test_a_short_trace_runs_warm_ups_then_abba_pairs_every_request_answered_with_counters(tmp_path: Path) -> None:
    """One model against one share (--single, steady): two warm-ups first, not counted, then two ABBA pairs; every
    request answered in every run; the report lists every run with its counters; the ratios come from the pairs."""
    proc = bench("--single", "--shape", "steady", "--pairs", "2", "--duration", "3", "--out", str(tmp_path))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads((tmp_path / "multimodel-transformers-cpu-steady-single-quick.json").read_text())
    runs = report["runs"]
    assert [(r["kind"], r["configuration"]) for r in runs] == [
        ("warm-up", "static"), ("warm-up", "elastic"),
        ("pair", "static"), ("pair", "elastic"), ("pair", "elastic"), ("pair", "static")]
    assert [r["counted"] for r in runs] == [False, False, True, True, True, True]
    assert [r["pair"] for r in runs] == [0, 0, 1, 1, 2, 2]
    assert report["single"] and report["models"] == 1 and report["pairs"] == 2 and report["trace_requests"] >= 2
    for run in runs:
        assert run["answered"] == run["requests"] == report["trace_requests"], run["run"]
        assert run["tokens"] > 0 and run["tokens_per_s"] > 0
        assert run["tpot_mean_s"] > 0  # decode time per output token: how fast a request ran once it ran
        ttfts = [ttft for _, _, ttft in run["ttft_by_arrival"]]
        assert len(ttfts) == run["requests"] and all(t is not None and t >= 0 for t in ttfts)
        # the counters: requests per step and steps counted in the engine, offload rounds; reclaims and bytes
        # claimed but unused read from the elastic segment; the plugin's own figures present, maybe "not published"
        assert run["steps"] > 0 and run["requests_per_step"] >= 1, run
        assert run["offload_rounds"] >= 0 and "refused" in run and "pooled_bytes" in run
        elastic = run["configuration"] == "elastic"
        for key in ("gave_count", "took_count", "unused_bytes_peak"):
            assert (run[key] is not None and run[key] >= 0) if elastic else run[key] is None, (key, run)
    pairs = [r for r in runs if r["counted"]]
    throughput = [e["tokens_per_s"] / s["tokens_per_s"] for s, e in ((pairs[0], pairs[1]), (pairs[3], pairs[2]))]
    assert round(min(throughput), 3) == report["throughput_ratio_min"]  # pair by pair, warm-ups left out
    tpot = [s["tpot_mean_s"] / e["tpot_mean_s"] for s, e in ((pairs[0], pairs[1]), (pairs[3], pairs[2]))]
    assert round(max(tpot), 3) == report["tpot_ratio_max"]
    table = (tmp_path / "multimodel-transformers-cpu-steady-single-quick.md").read_text()
    assert table.count("| warm-up (not counted) |") == 2 and table.count("| pair ") == 4
    assert f"Decode time per output token (each request's mean TPOT, averaged over the run) static/elastic: median " \
           f"{report['tpot_ratio_median']}x" in table
    assert "| pair 2 | static |" in out  # the report is printed too
    assert not segment_dirs(proc.pid)  # its segment directory went with it


def test_ctrl_c_while_it_runs_stops_every_engine_and_removes_its_segments() -> None:
    proc = bench("--pairs", "1", "--no-write")
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
            made = segment_dirs(proc.pid)
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
    assert not segment_dirs(proc.pid), segment_dirs(proc.pid)
    assert not list(Path(tempfile.gettempdir()).glob(f"kvc-tcb-logs-{proc.pid}-*"))  # logs are kept on failure only


def test_bad_duration_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers",
                           "--duration", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--duration must be more than 0 seconds" in proc.stderr
    assert "Traceback" not in proc.stderr
