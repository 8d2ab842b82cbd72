"""Ctrl-C in ``python -m benchmarks multimodel`` while its engines start: every engine process is gone and the
command exits 130, as with the transformers driver (tests/test_bench_multimodel_tcb.py): one rule, in
``benchmarks/fair/run.py``, for every engine."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.fair import vllm as driver

ROOT = Path(__file__).resolve().parents[1]


def default_signals() -> None:
    """``preexec_fn``: SIGINT at its default (a test run in the background inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_engines_start_leaves_no_engine_process(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"models": 2, "requests": driver.make_trace(seed=1, models=2, duration_s=6.0)}))
    bench = subprocess.Popen([sys.executable, "-m", "benchmarks", "multimodel", "--trace", str(trace), "--no-write"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=default_signals)
    try:
        # Wait until the engines have processes of their own below their servers (EngineCore started).
        deadline = time.monotonic() + 240
        seen: dict[int, float] = {}
        while time.monotonic() < deadline:
            kids = psutil.Process(bench.pid).children(recursive=True)
            servers = 0
            for kid in kids:
                with contextlib.suppress(psutil.NoSuchProcess):
                    seen.setdefault(kid.pid, kid.create_time())
                    servers += kid.ppid() == bench.pid
            if servers == 4 and len(kids) > servers:
                break
            time.sleep(0.5)
        assert len(seen) > 4, f"the engines did not start in time: {len(seen)} processes"
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 130, err[-2000:]
    assert "interrupted: every engine was stopped" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    left = []
    for pid, created in seen.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(proc.cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    assert not left, left
