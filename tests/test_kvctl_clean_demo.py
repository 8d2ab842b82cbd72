"""kvctl clean removes only your own dead segments; kvctl demo leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, kvctl, wait_heartbeat_late
from procs import Processes


def stale(spawn_allocator, name: str) -> Path:
    proc = spawn_allocator(name)
    proc.kill()
    proc.wait()
    path = Path(os.environ["KVCACHED_SHM_DIR"]) / f"kvc.{name}"
    wait_heartbeat_late(path)  # a segment whose heartbeat is fresh is kept
    return path


def segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("kvc."))


def test_clean_dry_run_then_clean(spawn_allocator, shm_dir: Path):
    spawn_allocator("alive")
    dead = stale(spawn_allocator, "dead")
    (shm_dir / "kvc.junk").write_bytes(b"\0" * 100)  # not a valid segment: never touched
    before = dead.read_bytes()

    dry = kvctl("clean", "--dry-run")
    assert dry.exit_code == 0 and dry.stderr == ""
    assert dry.stdout.startswith(f"would remove {dead} (model dead, pid ")
    assert dead.read_bytes() == before

    done = kvctl("clean")
    assert done.exit_code == 0 and done.stderr == ""
    assert done.stdout.startswith(f"removed {dead} (model dead")
    assert segments(shm_dir) == ["kvc.alive", "kvc.junk"]

    again = kvctl("clean")
    assert again.exit_code == 0 and again.stdout == "nothing to clean\n"


def test_clean_keeps_a_stale_segment_whose_process_still_runs(spawn_allocator, shm_dir: Path):
    proc = spawn_allocator("paused")
    os.kill(proc.pid, signal.SIGSTOP)  # its heartbeat goes stale, yet the process lives
    try:
        deadline = time.monotonic() + 20
        while not json.loads(kvctl("list", "--all", "--json").stdout)[0]["late"]:  # live, but late
            assert time.monotonic() < deadline
            time.sleep(0.2)
        done = kvctl("clean")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert done.exit_code == 0 and done.stdout == "nothing to clean\n"
    assert done.stderr.count("\n") == 1 and "still runs" in done.stderr
    assert segments(shm_dir) == ["kvc.paused"]


def test_clean_keeps_another_users_segment(spawn_allocator, shm_dir: Path):
    if os.getuid() != 0:
        pytest.skip("needs root to give a segment to another user")
    theirs = stale(spawn_allocator, "theirs")
    os.chown(theirs, 4321, 4321)
    before = theirs.read_bytes()
    done = kvctl("clean")
    assert done.exit_code == 0 and done.stdout == "nothing to clean\n"
    assert done.stderr == f"kvctl: warning: kept {theirs}: it belongs to uid 4321, not you\n"
    assert theirs.read_bytes() == before


def demo(procs: Processes, *args: str) -> subprocess.Popen:
    """``kvctl demo ARGS`` as from a terminal, in its own process group (ended at teardown)."""
    return procs.start([sys.executable, "-m", "kvtop.cli", "demo", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)


def live_names() -> list[str]:
    return sorted(r["name"] for r in json.loads(kvctl("list", "--json").stdout) if r["status"] == "live")


def test_demo_runs_for_its_duration_and_cleans_up(shm_dir: Path, procs: Processes):
    proc = demo(procs, "--models", "2", "--duration", "4", "--seed", "3")
    first = proc.stdout.readline()
    assert first.startswith("demo: 2 simulated models running: demo-llama-3-8b, demo-qwen2-7b"), proc.stderr.read()
    assert live_names() == ["demo-llama-3-8b", "demo-qwen2-7b"]
    deadline = time.monotonic() + 30  # traffic: blocks get used and some go to the prefix cache
    while not all(r["blocks_used"] for r in json.loads(kvctl("list", "--json").stdout)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in proc.stderr.read()
    assert segments(shm_dir) == []


def test_demo_ctrl_c_stops_every_model(shm_dir: Path, procs: Processes):
    proc = demo(procs, "--models", "3")
    assert proc.stdout.readline().startswith("demo: 3 simulated models running")
    assert len(live_names()) == 3
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does: the whole process group
    assert proc.wait(timeout=60) == 130
    assert "Traceback" not in proc.stderr.read()
    assert segments(shm_dir) == []


def test_demo_refuses_to_start_twice(shm_dir: Path, procs: Processes):
    first = demo(procs, "--models", "1", "--duration", "30")
    try:
        assert first.stdout.readline().startswith("demo: 1 simulated model running")
        second = kvctl("demo", "--models", "1")
        assert second.exit_code == 1 and "already exists (live" in second.stderr
        assert second.stderr.count("\n") == 1
        assert live_names() == ["demo-llama-3-8b"]
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 128 + signal.SIGTERM
    assert segments(shm_dir) == []


def test_clean_removes_half_created_segments_of_dead_processes(shm_dir: Path):
    """A creator killed between creating its hidden file and naming it leaves `.kvc-new.<name>.<pid>`."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited and reaped: no such process now
    dead = shm_dir / f".kvc-new.llama.{dead_pid}"
    dead.write_bytes(b"\0" * 4096)
    live = shm_dir / f".kvc-new.qwen.{os.getpid()}"  # still being created, as far as anyone can tell
    live.write_bytes(b"\0" * 4096)
    other = shm_dir / ".kvc-new.notes"  # not a creator's file: no pid
    other.write_bytes(b"x")
    result = kvctl("clean", "--dry-run")
    assert result.exit_code == 0 and f"would remove {dead} (a segment pid {dead_pid} never finished" in result.output
    assert dead.exists()
    result = kvctl("clean")
    assert result.exit_code == 0 and f"removed {dead}" in result.output
    assert not dead.exists() and live.exists() and other.exists()
    assert kvctl("clean").output.strip() == "nothing to clean"
