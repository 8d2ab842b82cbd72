"""Crash: an allocator killed with SIGKILL turns stale fast, readers survive, and a restart under its name works."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import child_env, send, wait_heartbeat_late

import kvcached_core as kc
from kvcached_core.segment.writer import SegmentError

STALE_WITHIN_S = 2.0


def model(name: str) -> kc.ModelSnapshot | None:
    return next((m for m in kc.list_models() if m.name == name), None)


def seconds_until_stale(name: str, since: float, limit: float = 10.0) -> float:
    """Poll list_models (which must never raise) until ``name`` is stale; the seconds it took."""
    while True:
        found = model(name)
        if found is not None and found.status == "stale":
            return time.monotonic() - since
        assert time.monotonic() - since < limit, f"{name} still {found and found.status} after {limit} s"
        time.sleep(0.01)


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def run_child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=child_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_sigkill_shows_stale_within_two_seconds(spawn_allocator, reaped):
    proc = spawn_allocator("victim", script="held = m.alloc(9)")
    assert model("victim").status == "live"
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    if reaped:
        proc.wait()
    else:  # the parent has not waited yet: the kernel keeps a zombie with the same pid and start time
        deadline = time.monotonic() + 5
        while process_state(proc.pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.005)
    assert seconds_until_stale("victim", killed) < STALE_WITHIN_S
    stale = model("victim")
    assert stale.pid == proc.pid
    assert stale.blocks_used == 9  # the last published figures stay readable for a post-mortem


def test_killed_in_the_middle_of_a_publish_reads_as_stale_and_empty(shm_dir):
    """A writer that dies between the two sequence bumps leaves the seqlock odd forever."""
    child = run_child("""
        import os, signal
        from kvcached_core.segment.writer import Identity, SegmentWriter
        w = SegmentWriter(Identity(name="torn", model="torn", engine="custom", backend="host", device=0,
                                   page_size=1 << 20, block_bytes=1 << 16, num_layers=2, num_kv_buffers=2,
                                   blocks_per_page=16, num_blocks=256, pages_total=16))
        w.begin()
        w.set_page(3, (1 << 31) | 5)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    found = kc.scan(with_pages=True)
    assert found.problems == ()
    (torn,) = found.models
    assert (torn.name, torn.status, torn.mapped_bytes, torn.blocks_used) == ("torn", "stale", 0, 0)
    assert list(torn.pages) == [0] * 16
    assert kc.snapshot("torn").status == "stale"


def test_readers_keep_working_while_a_busy_allocator_is_killed(spawn_allocator, tmp_path):
    """Kill allocators at arbitrary points of a hot alloc/free loop while a reader process scans."""
    stop = tmp_path / "stop"
    reader = run_child(f"""
        import os, kvcached_core as kc
        scans = 0
        while not os.path.exists({str(stop)!r}):
            found = kc.scan(with_pages=True)
            for m in found.models:
                kc.fragmentation(m)
            scans += 1
        print(scans, flush=True)
    """)
    hot = "import threading\ndef churn():\n    while True:\n        b = m.alloc(3)\n        m.free(b)\n" \
          "threading.Thread(target=churn, daemon=True).start()"
    for round_ in range(4):
        proc = spawn_allocator(f"busy{round_}", script=hot)
        time.sleep(0.05 + 0.03 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        assert seconds_until_stale(f"busy{round_}", killed) < STALE_WITHIN_S
    stop.touch()
    assert reader.wait(timeout=30) == 0
    assert int(reader.stdout.read()) > 0
    assert [m.status for m in kc.list_models()] == ["stale"] * 4
    assert kc.scan().problems == ()


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_restart_under_the_same_name_replaces_its_stale_segment(spawn_allocator, shm_dir, reaped):
    first = spawn_allocator("svc", script="held = m.alloc(4)")
    os.kill(first.pid, signal.SIGKILL)
    if reaped:
        first.wait()
    seconds_until_stale("svc", time.monotonic())
    second = spawn_allocator("svc", script="held = m.alloc(1)")
    (svc,) = kc.list_models()
    assert (svc.name, svc.pid, svc.status, svc.blocks_used) == ("svc", second.pid, "live", 1)
    assert [f for f in os.listdir(shm_dir) if f.startswith("kvc.")] == ["kvc.svc"]
    ack = kc.request_limit("svc", 8 << 20, wait=5)
    assert ack.status == "applied"
    send(second, "assert m.limit_pages is not None")


def test_a_restart_by_model_name_reuses_the_stale_name(shm_dir):
    """Without an explicit name the segment name comes from the model; a dead predecessor's name is reused."""
    code = """
        import sys
        from kvcached_core import KVCacheManager
        m = KVCacheManager("org/Model-7B", num_blocks=64, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)
        print(m.name, flush=True)
        sys.stdin.readline()
    """
    first = run_child(code)
    assert first.stdout.readline().strip() == "org_Model-7B"
    first.kill()
    first.wait()
    second = run_child(code)
    third = None
    try:
        assert second.stdout.readline().strip() == "org_Model-7B"
        third = run_child(code)  # while the second runs: must not collide with it
        assert third.stdout.readline().strip() == f"org_Model-7B-{third.pid}"
        names = {m.name: m for m in kc.list_models()}
        assert names["org_Model-7B"].pid == second.pid
        assert names[f"org_Model-7B-{third.pid}"].status == "live"
    finally:
        for proc in (second, third):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_a_live_holder_of_the_name_is_never_replaced(spawn_allocator):
    holder = spawn_allocator("taken")
    with pytest.raises(SegmentError, match=rf"'taken' is taken: .* in use by a live allocator \(pid {holder.pid}\)"):
        kc.KVCacheManager("taken", name="taken", num_blocks=16, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)
    assert model("taken").pid == holder.pid
    send(holder, "m.alloc(1)")


def tool(*argv: str) -> subprocess.CompletedProcess:
    """Run ``kvctl`` / ``kvtop`` as a user would (a wide terminal for kvtop's table)."""
    module = {"kvctl": "kvtop.cli", "kvtop": "kvtop.app"}[argv[0]]
    env = dict(child_env(), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", module, *argv[1:]], env=env, capture_output=True, text=True,
                          timeout=60)


def test_kvctl_and_kvtop_show_the_crash_and_kvctl_clean_removes_it(spawn_allocator, shm_dir):
    spawn_allocator("alive")
    victim = spawn_allocator("victim", script="held = m.alloc(5)")
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.wait()
    while True:  # within 2 s, both tools say so
        listed = tool("kvctl", "list", "--all", "--json")
        assert listed.returncode == 0, listed.stderr
        status = {m["name"]: m["status"] for m in json.loads(listed.stdout)}
        if status.get("victim") == "stale":
            break
        assert time.monotonic() - killed < STALE_WITHIN_S
    assert status == {"alive": "live", "victim": "stale"}
    once = tool("kvtop", "--once")
    assert once.returncode == 0 and "Traceback" not in once.stderr
    rows = {line.split()[1]: line for line in once.stdout.splitlines() if line.split()[1:2] in (["alive"], ["victim"])}
    assert "stale" in rows["victim"] and "live" in rows["alive"]

    wait_heartbeat_late(shm_dir / "kvc.victim")  # clean keeps a segment whose heartbeat is fresh
    cleaned = tool("kvctl", "clean")
    assert cleaned.returncode == 0, cleaned.stderr
    assert f"removed {shm_dir / 'kvc.victim'}" in cleaned.stdout
    assert not (shm_dir / "kvc.victim").exists() and (shm_dir / "kvc.alive").exists()
    assert [m.name for m in kc.list_models()] == ["alive"]
    again = tool("kvctl", "clean")
    assert again.returncode == 0 and "nothing to clean" in again.stdout
