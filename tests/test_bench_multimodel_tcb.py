"""``python -m benchmarks multimodel --engine transformers`` on CPU: a short trace end to end (static and elastic
engines, interleaved repeats, the report's fields), and Ctrl-C while it runs leaves no engine process and no
segment directory behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import _multimodel_tcb as tcb

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
UNSUPPORTED = tcb.check_machine("cpu")  # why this machine cannot run it (a transformers outside the range), or None
pytestmark = pytest.mark.skipif(UNSUPPORTED is not None, reason=str(UNSUPPORTED))


def segment_dirs() -> set[Path]:
    """The benchmark's segment directories that exist now (it makes one per run, under /dev/shm when it can)."""
    return set(SHM.glob("kvc-tcb-*")) if SHM.is_dir() else set()


def test_a_short_trace_is_answered_by_both_configurations_in_interleaved_repeats(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two repeats of a 4-second trace: every request answered in every run, the runs interleaved, the report's
    ratios and per-request figures written."""
    short = dataclasses.replace(tcb.MODELS["cpu"], duration_s=8.0)  # --quick halves it: 4 s of arrivals
    monkeypatch.setitem(tcb.MODELS, "cpu", short)
    monkeypatch.setattr(tcb, "RESULTS", tmp_path)
    before = segment_dirs()
    assert tcb.run("cpu", quick=True, repeats=2, write=True) == 0
    report = json.loads((tmp_path / "multimodel-transformers-cpu-quick.json").read_text())
    assert [r["configuration"] for r in report["runs"]] == ["static", "elastic", "static", "elastic"]
    assert report["trace_requests"] >= 2 and report["seed"] == tcb.SEED and report["engine"] == "transformers"
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
    assert segment_dirs() <= before  # its segment directory went with it


def test_ctrl_c_while_it_runs_stops_every_engine_and_removes_its_segments() -> None:
    before = segment_dirs()

    def default_sigint() -> None:  # a test run in the background inherits SIGINT ignored; the benchmark must see it
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    bench = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers", "--device", "cpu", "--quick",
         "--repeats", "1", "--no-write"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint)
    seen: dict[int, float] = {}
    try:
        # both configurations' engines (three each) are up and the elastic ones have made their segments
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            engines = 0
            for kid in psutil.Process(bench.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    seen.setdefault(kid.pid, kid.create_time())
                    engines += "spawn_main" in " ".join(kid.cmdline())
            made = segment_dirs() - before
            if engines == 6 and any(any(d.iterdir()) for d in made if d.is_dir()):
                break
            time.sleep(0.5)
        assert engines == 6, f"the engines did not start in time: {engines} of 6"
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 130, err[-2000:]
    assert "interrupted: every engine was stopped" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    left = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(proc.cmdline())[:120])
    assert not left, left
    assert segment_dirs() <= before, segment_dirs() - before
