"""The figures of a model whose writer stays inside a publish while its process runs.

A process stopped (SIGSTOP, a debugger, a host swapping it out) between the two sequence bumps of a
publish leaves the seqlock odd: no copy passes it until the process runs again. Its memory is still
held, so readers must still show it: late, with the last figures that can be known and when they
were true (``ModelSnapshot.figures_ns``). In order of trust:

1. **the publish before**: the counters still verify against the sequence before the odd one (the
   writer stopped before it wrote a counter); they were true at their publish time. Their page map
   is taken where it still sums to them (entries written since are newer), else from 2 when that
   copy holds the same counters.
2. **the last consistent copy this process read** of the same file (:func:`remember`, per
   segment, checked against the file's inode and header): true when it was read.
3. **the publish in progress**: the writer writes every page entry before a counter, so once a
   counter changed the page map is whole: its counts give the page and block figures, and every
   other counter is one 8-byte store, this publish's value or the one before's. Taken only where
   every entry could be one the allocator writes.

Nothing of this applies while a copy passes the seqlock, nor to a writer that is gone (its
half-written numbers are never shown: the reader shows it stale and empty).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from . import layout as L
from .pagemap import count_pages
from .sealed import Words, read_words

_NO_FIELD = 0xFFFFFFFF & ~(L.PAGE_MAPPED | L.PAGE_FIELD_MASK << L.PAGE_CACHED_SHIFT | L.PAGE_FIELD_MASK)  # bit 30

REMEMBERED_MAX = 4096  # segments whose last consistent copy is kept; past this many the memory starts again


def unpublished_counters() -> dict:
    """The counters of a segment never published (sequence 0): all zero, no limit."""
    counters = dict.fromkeys(L.COUNTER_FIELDS, 0)
    counters["effective_limit"] = -1
    counters["requested_limit"] = -1
    return counters


@dataclass(frozen=True)
class Consistent:
    """A consistent copy of one segment file as the reader decoded it, and when it was read."""

    key: tuple[int, int, bytes]  # the file's st_dev, st_ino and header bytes
    counters: dict
    pages: array | None
    words: Words
    read_ns: int


@dataclass(frozen=True)
class Held:
    """What a reader shows of a stopped writer: counters, page map (None: unknown), sealed words, and when true."""

    counters: dict
    pages: array | None
    words: Words
    figures_ns: int


class _Memory:
    """Per segment path, read by this process: the last consistent copy, and the odd sequence its writer was
    last found stopped at. Both name the file they are of (``key``): another file at the path has neither."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[str, Consistent] = {}
        self._stuck: dict[str, tuple[tuple[int, int, bytes], int]] = {}

    def copy(self, path: str, key: tuple[int, int, bytes]) -> Consistent | None:
        copy = self._copies.get(path)
        return copy if copy is not None and copy.key == key else None

    def stuck(self, path: str, key: tuple[int, int, bytes]) -> int:
        found = self._stuck.get(path)
        return found[1] if found is not None and found[0] == key else -1

    def put(self, path: str, copy: Consistent) -> None:
        with self._lock:
            if len(self._copies) >= REMEMBERED_MAX and path not in self._copies:
                self._copies.clear()
            self._copies[path] = copy

    def put_stuck(self, path: str, key: tuple[int, int, bytes], seq: int) -> None:
        with self._lock:
            if len(self._stuck) >= REMEMBERED_MAX and path not in self._stuck:
                self._stuck.clear()
            self._stuck[path] = (key, seq)

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()
            self._stuck.clear()


_MEMORY = _Memory()


def remember(path: str, key: tuple[int, int, bytes], counters: dict, pages: array | None, words: Words,
             read_ns: int) -> None:
    """Keep the consistent copy of ``path`` (the file ``key`` names) read at ``read_ns``, for a later stuck read."""
    _MEMORY.put(path, Consistent(key, counters, pages, words, read_ns))


def stuck_seq(path: str, key: tuple[int, int, bytes]) -> int:
    """The odd sequence the writer of ``path`` was last found stopped at (-1: none): a read that finds it there
    again knows at once, without waiting out the retries again."""
    return _MEMORY.stuck(path, key)


def forget() -> None:
    """Drop everything kept: the next reads are a fresh process's."""
    _MEMORY.clear()


def held(path: str, key: tuple[int, int, bytes], header: dict, raw: bytes, with_pages: bool,
         read_map: Callable[[], bytes]) -> Held | None:
    """The figures to show of the writer stopped inside a publish whose copy is ``raw`` (up to the page map, or
    the whole file when ``with_pages``); None when none can be known. ``read_map`` reads the page map."""
    seq = L.U64.unpack_from(raw, L.SEQ_OFF)[0]
    last = _MEMORY.copy(path, key)
    result = _before(raw, header, seq, with_pages, last) or _remembered(last, raw, header, with_pages) \
        or _in_progress(raw, header, with_pages, read_map)
    if result is not None:
        _MEMORY.put_stuck(path, key, seq)
    return result


def _map(raw: bytes, header: dict) -> array:
    pages = array("I")
    pages.frombytes(raw[L.PAGE_MAP_OFF:L.PAGE_MAP_OFF + 4 * header["pages_total"]])
    return pages


def _counters_at(raw: bytes, seq: int) -> dict | None:
    """The counters of ``raw`` when they verify against the even sequence ``seq``, else None."""
    if seq == 0:
        return unpublished_counters()
    if L.U64.unpack_from(raw, L.CHECKSUM_OFF)[0] != L.counters_checksum(raw[L.COUNTERS_OFF:L.CHECKSUM_OFF], seq):
        return None
    return dict(zip(L.COUNTER_FIELDS, L.COUNTERS.unpack_from(raw, L.COUNTERS_OFF), strict=False))


def _before(raw: bytes, header: dict, seq: int, with_pages: bool, last: Consistent | None) -> Held | None:
    """1: the publish before the one under way, when not one of its counters was written yet."""
    counters = _counters_at(raw, seq - 1)
    if counters is None:
        return None
    same = last is not None and last.counters == counters
    pages = None
    if with_pages:
        pages = _map(raw, header)
        if sum(pages) & 0xFFFFFFFFFFFFFFFF != counters["page_sum"]:
            pages = last.pages if same and last is not None else None
    true_at = max(counters["updated_ns"], header["created_ns"], last.read_ns if same and last is not None else 0)
    return Held(counters, pages if with_pages else None, read_words(raw, header, counters, None), true_at)


def _remembered(last: Consistent | None, raw: bytes, header: dict, with_pages: bool) -> Held | None:
    """2: the last consistent copy this process read of the file; its sealed blocks as the file holds them where
    each is whole (their own seqlocks: the engine's traffic may have been published since that copy), else as that
    copy had them."""
    if last is None:
        return None
    words = read_words(raw, header, last.counters, None)
    return Held(last.counters, last.pages if with_pages else None, words if words.whole else last.words,
                last.read_ns)


def _in_progress(raw: bytes, header: dict, with_pages: bool, read_map: Callable[[], bytes]) -> Held | None:
    """3: the publish under way, past its page entries: the map counted, the other counters as they stand."""
    map_raw = read_map()
    if len(map_raw) != 4 * header["pages_total"]:
        return None
    pages = array("I")
    pages.frombytes(map_raw)
    per_page = header["blocks_per_page"]
    for entry in pages:
        mapped, used, cached = L.decode_page(entry)
        if used > per_page or cached > used or (used and not mapped) or entry & _NO_FIELD:
            return None  # no allocator writes this entry: the file is damaged, not stopped
    counts = count_pages(pages)
    if counts.blocks_used > header["num_blocks"]:
        return None
    counters = dict(zip(L.COUNTER_FIELDS, L.COUNTERS.unpack_from(raw, L.COUNTERS_OFF), strict=False))
    bundle = header["page_size"] * header["num_layers"] * header["num_kv_buffers"] * max(1, header["tp_world"])
    counters.update(pages_inuse=counts.inuse, pages_reserved=counts.reserved, blocks_used=counts.blocks_used,
                    blocks_cached=counts.blocks_cached, mapped_bytes=(counts.inuse + counts.reserved) * bundle,
                    page_sum=sum(pages) & 0xFFFFFFFFFFFFFFFF)
    true_at = max(counters["updated_ns"], header["created_ns"])
    return Held(counters, pages if with_pages else None, read_words(raw, header, counters, None), true_at)
