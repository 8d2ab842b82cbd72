"""Concurrency: writers hammer segments while reader processes snapshot them; readers never stall a writer."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

from conftest import child_env, send
from seqlock_stress import Workload, identity, stress, violations

import kvcached_core as kc
from kvcached_core.segment.writer import SegmentWriter

TOTAL_UPDATES = 1_000_000


def test_a_million_updates_and_no_torn_snapshot_accepted(shm_dir):
    """Two writers publish 500 000 updates each; three readers check every snapshot they accept."""
    result = stress(writers=2, readers=3, updates_per_writer=TOTAL_UPDATES // 2, directory=str(shm_dir))
    assert result.updates >= TOTAL_UPDATES
    assert result.violation_count == 0, result.violations
    # Every reader got consistent copies while the writers hammered (thousands on a plain Linux host; a
    # handful under gVisor, whose slow syscalls leave a reader almost no window between two publishes).
    assert all(r["accepted"] > 0 for r in result.readers), result.readers


def test_the_invariants_catch_a_mixed_copy(shm_dir):
    """A copy that mixes two updates, as a torn read would, breaks the invariants the stress test checks."""
    writer = SegmentWriter(identity("mix"))
    work = Workload(writer, 1)
    try:
        work.update(1)
        before = kc.snapshot("mix")
        assert violations(before, 1) == []
        work.update(2)
        after = kc.snapshot("mix")
        assert violations(after, 1) == []
        mixed = before.__class__(**{**before.__dict__, "alloc_count": after.alloc_count})
        assert violations(mixed, 1)
        old_map = before.__class__(**{**after.__dict__, "pages": before.pages})
        assert violations(old_map, 1)
        for field in ("applied_revision", "trim_ack_seq", "trim_bytes", "limit_bytes", "limit_status",
                      "free_count", "alloc_blocks", "free_blocks", "updated_ns", "trimmed_total", "evicted_blocks"):
            torn = before.__class__(**{**after.__dict__, field: getattr(before, field)})
            assert any(v.startswith(f"{field}=") for v in violations(torn, 1)), f"a torn {field} passes"
    finally:
        writer.close()


def test_a_controller_holding_the_lock_or_a_stopped_reader_never_stalls_the_allocator(spawn_allocator, shm_dir):
    proc = spawn_allocator("steady", script="held = []")
    path = shm_dir / "kvc.steady"
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import kvcached_core as kc
        while True:
            kc.scan(with_pages=True)
    """)], env=child_env())
    lock = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a controller that hangs while holding the control lock
        os.kill(reader.pid, signal.SIGSTOP)  # a reader frozen at an arbitrary point of its copy
        for _ in range(200):
            send(proc, "held.append(m.alloc(2))")
        send(proc, "[m.free(b) for b in held]; m.trim()")
        snap = kc.snapshot("steady")
        assert (snap.alloc_count, snap.free_count, snap.blocks_used) == (200, 200, 0)
        assert snap.status == "live"
    finally:
        os.close(lock)
        os.kill(reader.pid, signal.SIGKILL)
        reader.wait()
