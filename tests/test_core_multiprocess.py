"""An allocator in a child process, a reader and controller in this one: the segment is the only link."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import freeze, send, wait_for

import kvcached_core as kc
from kvcached_core.segment import layout as L

MiB = 1024 * 1024
BUNDLE = 1 * MiB  # the fixture's child: 256 KiB pages x 2 layers x K/V; 4 blocks of 64 KiB per page


@pytest.fixture(autouse=True)
def _no_idle_return(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children inherit this: the idle return must not empty a pool a test is counting."""
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")



def pages_of(snap: kc.ModelSnapshot) -> list[tuple[bool, int, int]]:
    return [L.decode_page(e) for e in snap.page_entries()]


def in_use_pages(snap: kc.ModelSnapshot) -> set[int]:
    return {p for p, (mapped, used, _c) in enumerate(pages_of(snap)) if used}


def assert_consistent(snap: kc.ModelSnapshot) -> None:
    entries = pages_of(snap)
    inuse = sum(1 for mapped, used, _ in entries if mapped and used)
    reserved = sum(1 for mapped, used, _ in entries if mapped and not used)
    assert all(mapped for mapped, used, _ in entries if used), "a page with used blocks is unmapped"
    assert (snap.pages_inuse, snap.pages_reserved) == (inuse, reserved)
    assert snap.blocks_used == sum(u for _, u, _ in entries)
    assert snap.mapped_bytes == (inuse + reserved) * snap.bundle_bytes


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_live_then_sigkill_reads_stale_within_two_seconds(spawn_allocator, reaped):
    proc = spawn_allocator("victim", script="m.alloc(6)")
    snap = kc.snapshot("victim")
    assert (snap.status, snap.pid, snap.blocks_used) == ("live", proc.pid, 6)
    assert snap.heartbeat_ns and time.time_ns() - snap.heartbeat_ns < 3e9
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    if reaped:
        proc.wait()
    wait_for(lambda: kc.snapshot("victim").status == "stale", timeout=2.0, what="status stale")
    assert time.monotonic() - killed < 2.0
    with pytest.raises(kc.ControlError, match="stale"):
        kc.request_limit("victim", 4 * MiB, wait=1)
    with pytest.raises(kc.ControlError, match="stale"):
        kc.request_trim("victim", wait=1)


def test_limit_round_trip_applies_raises_and_lifts(spawn_allocator):
    spawn_allocator("lim", script="a = m.alloc(8)")  # two pages in use
    ack = kc.request_limit("lim", 6 * MiB + 123, wait=5)
    assert (ack.kind, ack.status, ack.revision, ack.effective_limit) == ("limit", "applied", 1, 6 * MiB)
    snap = kc.snapshot("lim")
    assert (snap.limit_bytes, snap.limit_status, snap.applied_revision, snap.requested_limit) == (
        6 * MiB, "applied", 1, 6 * MiB + 123)
    assert snap.mapped_bytes <= 6 * MiB
    assert_consistent(snap)

    ack = kc.request_limit("lim", 64 * MiB, wait=5)  # raising applies at once
    assert (ack.status, ack.revision, ack.effective_limit) == ("applied", 2, 64 * MiB)

    ack = kc.request_limit("lim", None, wait=5)
    assert (ack.status, ack.revision, ack.effective_limit) == ("none", 3, None)
    snap = kc.snapshot("lim")
    assert (snap.limit_bytes, snap.limit_status, snap.requested_limit) == (None, "none", None)


def test_lowered_limit_is_deferred_then_applied_as_pages_empty(spawn_allocator):
    proc = spawn_allocator("shrink", script="a = m.alloc(32)")  # eight whole pages in use
    wait_for(lambda: kc.snapshot("shrink").pages_reserved == 5, what="the reserve pool to fill")
    before = kc.snapshot("shrink")
    held = in_use_pages(before)
    assert len(held) == 8

    ack = kc.request_limit("shrink", 3 * MiB, wait=5)
    assert (ack.status, ack.effective_limit) == ("deferred", 3 * MiB)
    snap = kc.snapshot("shrink")
    assert snap.display_status == "shrinking"
    assert in_use_pages(snap) == held, "a page in use was unmapped by a lower limit"
    assert snap.pages_reserved == 0, "reserved pages stay mapped above the limit"
    assert snap.mapped_bytes == 8 * BUNDLE
    assert_consistent(snap)

    send(proc, "m.free(a[:8])")  # two pages empty: returned at once, still above the limit
    snap = kc.snapshot("shrink")
    assert (snap.limit_status, snap.pages_inuse, snap.pages_reserved, snap.mapped_bytes) == ("deferred", 6, 0, 6 * MiB)
    assert_consistent(snap)
    send(proc, "assert m.alloc(4) is None, 'a new page under a deferred limit'")

    send(proc, "m.free(a[8:20])")  # three more pages: now within the limit, without a new request
    snap = wait_for(lambda: (s := kc.snapshot("shrink")).limit_status == "applied" and s, what="applied")
    assert snap.pages_inuse == 3 and snap.mapped_bytes <= 3 * MiB
    assert (snap.limit_revision, snap.applied_revision) == (ack.revision, ack.revision)
    assert snap.display_status == "live"
    assert_consistent(snap)


def test_trim_round_trip_returns_the_pool_and_it_stays_returned(spawn_allocator):
    proc = spawn_allocator("trimmed", script="a = m.alloc(6)")  # two pages in use
    wait_for(lambda: kc.snapshot("trimmed").pages_reserved == 5, what="the reserve pool to fill")
    ack = kc.request_trim("trimmed", wait=5)
    assert (ack.kind, ack.status, ack.revision, ack.bytes_returned) == ("trim", "trimmed", 1, 5 * BUNDLE)
    assert ack.latency_s < 5
    snap = kc.snapshot("trimmed")
    assert (snap.pages_reserved, snap.pages_inuse, snap.mapped_bytes) == (0, 2, 2 * BUNDLE)
    assert (snap.trim_seq, snap.trim_ack_seq, snap.trim_bytes, snap.trimmed_total) == (1, 1, 5 * BUNDLE, 5 * BUNDLE)
    assert_consistent(snap)
    time.sleep(0.3)  # an idle model stays trimmed: nothing refills without traffic
    assert kc.snapshot("trimmed").pages_reserved == 0

    send(proc, "m.free(a)")  # two empty pages go back to the pool; a second trim returns them
    ack = kc.request_trim("trimmed", wait=5)
    assert (ack.revision, ack.bytes_returned) == (2, 2 * BUNDLE)
    assert kc.snapshot("trimmed").mapped_bytes == 0


def test_a_stopped_allocator_times_out_then_applies_when_it_resumes(spawn_allocator):
    proc = spawn_allocator("frozen")
    freeze(proc.pid)
    try:
        with pytest.raises(kc.AckTimeout, match="did not acknowledge the limit within 0.3 s") as info:
            kc.request_limit("frozen", 5 * MiB, wait=0.3)
        assert (info.value.ack.status, info.value.ack.revision) == ("pending", 1)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    snap = wait_for(lambda: (s := kc.snapshot("frozen")).applied_revision == 1 and s, what="the late ack")
    assert (snap.limit_bytes, snap.limit_status) == (5 * MiB, "applied")


def test_a_restart_under_the_same_name_replaces_its_own_stale_segment(spawn_allocator, shm_dir):
    first = spawn_allocator("phoenix", script="m.alloc(9)")
    first.kill()
    first.wait()
    assert kc.snapshot("phoenix").status == "stale"
    second = spawn_allocator("phoenix")
    snap = kc.snapshot("phoenix")
    assert (snap.status, snap.pid, snap.blocks_used) == ("live", second.pid, 0)
    assert sorted(p.name for p in shm_dir.iterdir() if p.name.startswith("kvc.")) == ["kvc.phoenix"]
    ack = kc.request_limit("phoenix", 2 * MiB, wait=5)
    assert (ack.status, ack.revision) == ("applied", 1)  # a fresh control block, not the dead one's
