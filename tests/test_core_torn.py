"""Torn reads: a reader never accepts a copy that mixes two publishes or a half-written one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import child_env, configured

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import SegmentCorrupt, read_segment

WRITER = textwrap.dedent("""
    import random, sys, time
    from kvcached_core import KVCacheManager
    m = KVCacheManager("torn", name="torn", num_blocks=2048, block_bytes=8192, num_layers=1, page_size=65536)
    rng, held, cached = random.Random(7), [], set()
    print("READY", flush=True)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        r = rng.random()
        if r < 0.45 or not held:
            got = m.alloc(rng.randint(1, 12))
            if got:
                held.append(got)
        elif r < 0.75:
            m.free(held.pop(rng.randrange(len(held))))
        elif r < 0.88:
            blocks = held.pop(rng.randrange(len(held)))
            cached |= set(blocks)
            cached -= set(m.mark_cached(blocks))
        elif r < 0.94 and cached:
            cached -= set(m.evict(rng.randint(1, 8)))
        elif cached:
            some = rng.sample(sorted(cached), min(len(cached), rng.randint(1, 6)))
            m.reuse(some)
            cached -= set(some)
            m.free(some)
    m.close()
""")


def check_snapshot(snap: kc.ModelSnapshot) -> None:
    """Counters and page map of one accepted copy must describe the same instant."""
    entries = [L.decode_page(e) for e in snap.page_entries()]
    assert len(entries) == snap.pages_total
    inuse = reserved = used_sum = cached_sum = 0
    for page, (mapped, used, cached) in enumerate(entries):
        assert cached <= used <= snap.blocks_per_page, f"page {page}: {used} used, {cached} cached"
        if used:
            assert mapped, f"page {page} holds blocks but is unmapped"
            inuse += 1
        elif mapped:
            reserved += 1
        used_sum += used
        cached_sum += cached
    assert (snap.pages_inuse, snap.pages_reserved) == (inuse, reserved)
    assert (snap.blocks_used, snap.blocks_cached) == (used_sum, cached_sum)
    assert snap.mapped_bytes == (inuse + reserved) * snap.bundle_bytes
    assert snap.alloc_blocks - snap.free_blocks - snap.evicted_blocks == snap.blocks_used


def test_a_reader_never_accepts_a_torn_copy_of_a_busy_writer(shm_dir):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, "6"], stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert proc.stdout.readline().strip() == "READY"
        path = shm_dir / "kvc.torn"
        accepted, busy, seen = 0, 0, set()
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            try:
                snap = read_segment(path, with_pages=True)
            except BlockingIOError:
                busy += 1
                continue
            check_snapshot(snap)
            accepted += 1
            seen.add(snap.alloc_count)
        assert proc.poll() is None, "the writer stopped before the reader did"
    finally:
        proc.kill()
        proc.wait()
    assert accepted >= 100, f"only {accepted} copies accepted ({busy} busy)"
    assert len(seen) >= 20, "the writer hardly moved while the reader read"


@pytest.fixture
def quiet_segment(shm_dir):
    """A real segment at two moments (A, then B after more traffic), with no thread publishing."""
    quiet = configured({"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_IDLE_RETURN_S": "-1"})
    with kc.KVCacheManager("copy", name="copy", num_blocks=64, block_bytes=8192, num_layers=1,
                           page_size=65536, settings=quiet) as m:
        first = m.alloc(11)
        m.mark_cached(first[:3])
        with m._lock:
            state_a = bytearray(m.segment.path.read_bytes())
        m.free(first[3:6])
        m.alloc(9)
        with m._lock:
            state_b = bytearray(m.segment.path.read_bytes())
        yield state_a, state_b


def write_copy(directory: Path, raw: bytes) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / "kvc.copy"
    path.write_bytes(bytes(raw))
    path.chmod(0o600)
    return path


def counters_span() -> slice:
    return slice(L.COUNTERS_OFF, L.CHECKSUM_OFF)


def bump_u64(raw: bytearray, offset: int, delta: int = 1) -> None:
    L.U64.pack_into(raw, offset, (L.U64.unpack_from(raw, offset)[0] + delta) & (2**64 - 1))


def test_an_intact_copy_is_accepted(quiet_segment, tmp_path):
    state_a, _ = quiet_segment
    snap = read_segment(write_copy(tmp_path / "ok", state_a), with_pages=True)
    check_snapshot(snap)
    assert (snap.blocks_used, snap.blocks_cached) == (11, 3)


def _odd_sequence(a: bytearray, b: bytearray) -> bytearray:
    bump_u64(a, L.SEQ_OFF)
    return a


def _page_entry_flipped(a: bytearray, b: bytearray) -> bytearray:
    a[L.PAGE_MAP_OFF] ^= 0x01  # page 0's used count, counters untouched
    return a


def _counter_flipped(a: bytearray, b: bytearray) -> bytearray:
    bump_u64(a, L.COUNTERS_OFF + 8 * L.COUNTER_FIELDS.index("blocks_used"))
    return a


def _checksum_flipped(a: bytearray, b: bytearray) -> bytearray:
    a[L.CHECKSUM_OFF + 3] ^= 0x40
    return a


def _new_page_map_old_counters(a: bytearray, b: bytearray) -> bytearray:
    a[L.PAGE_MAP_OFF:] = b[L.PAGE_MAP_OFF:]
    return a


def _new_counters_old_sequence(a: bytearray, b: bytearray) -> bytearray:
    b[counters_span()] = a[counters_span()]
    b[L.CHECKSUM_OFF:L.CHECKSUM_OFF + 8] = a[L.CHECKSUM_OFF:L.CHECKSUM_OFF + 8]
    b[L.PAGE_MAP_OFF:] = a[L.PAGE_MAP_OFF:]  # A's payload under B's (even, later) sequence number
    return b


# An odd sequence alone, its writer alive, is a publish under way that nothing was written by yet: the figures
# before it are whole and shown, late (tests/test_frozen_publish_reader.py).
@pytest.mark.parametrize("damage", [_page_entry_flipped, _counter_flipped, _checksum_flipped,
                                    _new_page_map_old_counters, _new_counters_old_sequence],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_half_written_copy_is_rejected_never_accepted(quiet_segment, tmp_path, damage):
    state_a, state_b = (bytearray(s) for s in quiet_segment)
    directory = tmp_path / damage.__name__
    path = write_copy(directory, damage(state_a, state_b))
    with pytest.raises((SegmentCorrupt, BlockingIOError)):
        read_segment(path, with_pages=True)
    result = kc.scan(directory=directory, with_pages=True)
    assert result.models == ()
    (problem,) = result.problems
    assert problem.path == str(path)
    assert problem.status in ("corrupt", "busy"), problem


def test_a_writer_that_died_mid_publish_leaks_none_of_its_half_written_numbers(quiet_segment, tmp_path):
    raw = _odd_sequence(bytearray(quiet_segment[0]), bytearray())
    fields = list(L.HEADER.unpack_from(raw, 0))
    fields[L.HEADER_FIELDS.index("pid")] = 2**22 - 1  # no such process
    L.HEADER.pack_into(raw, 0, *fields)
    write_copy(tmp_path / "dead", raw)
    (snap,) = kc.scan(directory=tmp_path / "dead", with_pages=True).models
    assert snap.status == "stale"
    assert (snap.blocks_used, snap.blocks_cached, snap.pages_inuse, snap.mapped_bytes) == (0, 0, 0, 0)
    assert not any(snap.page_entries())


def test_failed_copies_while_the_writer_moves_are_not_called_corrupt(quiet_segment, tmp_path, monkeypatch):
    """A copy made while the writer publishes can fail its checksum although the sequence matched around
    it (the kernel may load the bytes out of order); only failures at one unchanging sequence make a
    file corrupt. Here the sequence moves between every two copies, as a busy writer's does."""
    import os

    from kvcached_core.segment import reader

    raw = _counter_flipped(bytearray(quiet_segment[0]), bytearray())
    path = write_copy(tmp_path / "moving", raw)
    fd = os.open(path, os.O_RDWR)

    def writer_publishes(attempt: int) -> None:  # between two copies, the writer finishes a publish
        seq = L.U64.unpack_from(os.pread(fd, 8, L.SEQ_OFF))[0]
        os.pwrite(fd, L.U64.pack(seq + 2), L.SEQ_OFF)

    monkeypatch.setattr(reader, "_backoff", writer_publishes)
    try:
        with pytest.raises(BlockingIOError, match="very busy"):
            read_segment(path, with_pages=True)
    finally:
        os.close(fd)
    monkeypatch.undo()  # the writer stops: the same bytes at one sequence are corrupt
    with pytest.raises(SegmentCorrupt, match="quiet segment"):
        read_segment(path, with_pages=True)


def test_a_model_too_busy_to_read_is_not_reported_missing_to_a_controller(quiet_segment, tmp_path, monkeypatch):
    """A limit for a model whose writer stays mid-publish (alive) is sent and waited for, then says the model
    did not answer and why; it used to say there was no such model."""
    from kvcached_core.control.requests import AckTimeout

    stuck = _odd_sequence(bytearray(quiet_segment[0]), bytearray())  # its writer (this process) lives
    directory = tmp_path / "stuck"
    write_copy(directory, stuck)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(directory))
    with pytest.raises(AckTimeout, match="did not acknowledge the limit within 1 s; its process runs but its heartbeat is late"):
        kc.request_limit("copy", 4 * 65536, wait=1)
    with pytest.raises(kc.ModelNotFound, match="no model named 'other'"):
        kc.request_limit("other", 4 * 65536, wait=1)
