"""The reader's answer for a writer that stays inside a publish, at each place a stop can leave it.

The segment is a real allocator's at two moments (A, then B after more traffic: tests/test_core_torn.py's
``quiet_segment``), its writer this process (alive); a copy of it is cut where a publish from A to B stands.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from test_core_torn import bump_u64, quiet_segment, write_copy  # noqa: F401 - quiet_segment: a fixture

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment import reader, stuck
from kvcached_core.segment.reader import read_segment

BLOCKS_A, BLOCKS_B = 11, 17  # A: 11 used (3 cached); B: 3 of them freed, 9 more


@pytest.fixture(autouse=True)
def fresh_reader():
    stuck.forget()  # each test reads as a process that never read the file
    yield
    stuck.forget()


def under_way(a: bytearray, b: bytearray, *, entries: bool, counter_words: int = 0) -> bytearray:
    """A with the publish to B begun (sequence odd), its page entries written or not, its first counters."""
    bump_u64(a, L.SEQ_OFF)
    if entries:
        a[L.PAGE_MAP_OFF:] = b[L.PAGE_MAP_OFF:]
    end = L.COUNTERS_OFF + 8 * counter_words
    a[L.COUNTERS_OFF:end] = b[L.COUNTERS_OFF:end]
    return a


@pytest.fixture
def moments(request: pytest.FixtureRequest) -> tuple[bytearray, bytearray]:
    """Copies of the segment at A and at B."""
    a, b = request.getfixturevalue("quiet_segment")
    return bytearray(a), bytearray(b)


def test_stopped_before_its_page_entries_shows_the_publish_before_with_its_map(moments, tmp_path):
    path = write_copy(tmp_path / "d", under_way(*moments, entries=False))
    snap = read_segment(path, with_pages=True)
    assert (snap.status, snap.display_status, snap.blocks_used, snap.blocks_cached) == ("live", "late", BLOCKS_A, 3)
    assert sum(L.decode_page(e)[1] for e in snap.page_entries()) == BLOCKS_A
    assert snap.figures_ns == snap.updated_ns  # true at their publish


def test_stopped_among_its_page_entries_shows_the_counters_before_without_the_newer_map(moments, tmp_path):
    path = write_copy(tmp_path / "d", under_way(*moments, entries=True))
    snap = read_segment(path, with_pages=True)
    assert (snap.display_status, snap.blocks_used) == ("late", BLOCKS_A)
    assert snap.pages is None  # the entries are B's: never shown as A's map
    (listed,) = kc.scan(directory=path.parent).models
    assert (listed.display_status, listed.blocks_used) == ("late", BLOCKS_A)


def test_a_reader_that_saw_the_copy_before_keeps_its_map(moments, tmp_path):
    a, b = moments
    path = write_copy(tmp_path / "d", a)
    seen = read_segment(path, with_pages=True)
    path.write_bytes(bytes(under_way(a, b, entries=True)))  # the same file (inode), now under way
    snap = read_segment(path, with_pages=True)
    assert snap.blocks_used == BLOCKS_A and list(snap.page_entries()) == list(seen.page_entries())
    assert snap.figures_ns >= seen.read_ns  # A's counters were still the last ones then


def test_stopped_among_its_counters_shows_the_remembered_copy_else_the_whole_map_counted(moments, tmp_path):
    a, b = moments
    path = write_copy(tmp_path / "d", a)
    seen = read_segment(path, with_pages=True)
    path.write_bytes(bytes(under_way(a, b, entries=True, counter_words=2)))
    remembered = read_segment(path, with_pages=True)
    assert (remembered.display_status, remembered.blocks_used, remembered.figures_ns) == ("late", BLOCKS_A,
                                                                                          seen.read_ns)
    stuck.forget()  # a fresh process: the map is B's, whole (entries come before counters)
    counted = read_segment(path, with_pages=True)
    assert (counted.display_status, counted.blocks_used, counted.blocks_cached) == ("late", BLOCKS_B, 3)
    final = read_segment(write_copy(tmp_path / "b", b), with_pages=True)
    assert (counted.pages_inuse, counted.pages_reserved, counted.mapped_bytes) == \
        (final.pages_inuse, final.pages_reserved, final.mapped_bytes)
    assert list(counted.page_entries()) == list(final.page_entries())

    # A map no allocator writes is the file damaged, not a writer stopped: never counted, the segment reads busy.
    for entry in (1 << 30, L.page_entry(True, 5, 6), L.page_entry(False, 1, 0)):  # a spare bit; cached > used;
        damaged = bytearray(path.read_bytes())                                    # used but unmapped
        struct.pack_into("<I", damaged, L.PAGE_MAP_OFF + 4 * 7, entry)
        path.write_bytes(bytes(damaged))
        stuck.forget()
        with pytest.raises(BlockingIOError, match="alive but stuck"):
            read_segment(path, with_pages=True)
        (problem,) = kc.scan(directory=path.parent).problems
        assert problem.status == "busy"


def test_once_found_stopped_the_next_reads_answer_without_waiting(moments, tmp_path, monkeypatch):
    path = write_copy(tmp_path / "d", under_way(*moments, entries=False))
    waits: list[int] = []
    monkeypatch.setattr(reader, "_backoff", waits.append)
    assert read_segment(path).late and len(waits) == reader.READ_RETRIES
    waits.clear()
    assert read_segment(path).late and kc.scan(directory=path.parent).models[0].late
    assert waits == []
    moved = bytearray(path.read_bytes())
    bump_u64(moved, L.SEQ_OFF, 2)  # another publish under way: waited out again (the writer may only be slow)
    Path(path).write_bytes(bytes(moved))
    read_segment(path)
    assert len(waits) == reader.READ_RETRIES


def test_the_remembered_copy_comes_with_the_sealed_blocks_published_since(shm_dir, tmp_path):
    """The counters are the copy this process read; the engine's traffic (its own seqlock) is what it published
    after that copy, before it stopped."""
    from conftest import configured

    quiet = configured({"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_IDLE_RETURN_S": "-1"})
    with kc.KVCacheManager("copy", name="copy", num_blocks=64, block_bytes=8192, num_layers=1, page_size=65536,
                           settings=quiet) as m:
        m.alloc(5)
        m.publish_traffic(1, 0, 0, 10, 0, 0, 1)
        with m._lock:
            before = bytearray(m.segment.path.read_bytes())
        m.publish_traffic(3, 1, 2, 40, 20, 0, 2)
        m.alloc(2)
        with m._lock:
            later = bytearray(m.segment.path.read_bytes())
    path = write_copy(tmp_path / "d", before)
    assert read_segment(path).traffic.running == 1  # type: ignore[union-attr]
    bump_u64(later, L.SEQ_OFF)  # the next publish under way, one counter written
    later[L.COUNTERS_OFF:L.COUNTERS_OFF + 8] = bytes(8)
    path.write_bytes(bytes(later))
    snap = read_segment(path)
    assert (snap.display_status, snap.blocks_used) == ("late", 5)
    assert snap.traffic is not None and (snap.traffic.running, snap.traffic.finished) == (3, 2)
