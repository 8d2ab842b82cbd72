"""The decoded page map: what front ends read instead of the page-map bits (see ``layout.PAGE_*``).

Page states, used and cached blocks per page, counts, evictable pages, and the folding of a map
into a fixed number of cells. Front ends (kvtop, kvctl, the exporter) use only this module; the
bit layout stays in :mod:`kvcached_core.segment.layout`. When there are more pages than cells, each cell
covers a group of pages and shows the group's dominant meaning: any in-use page makes the cell in
use (with the group's mean occupancy of its in-use pages), else any reserved page makes it
reserved, else it is free. A cell whose used blocks are all cached shows as cached.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from . import layout as L

FREE, RESERVED, CACHED, LOW, MID, HIGH, FULL = "free", "reserved", "cached", "low", "mid", "high", "full"
STATES = (FREE, RESERVED, CACHED, LOW, MID, HIGH, FULL)

page_entry = L.page_entry  # encodes one entry (mapped, used, cached): for hand-made maps
decode_page = L.decode_page  # one entry as (mapped, used blocks, cached blocks)


@dataclass(frozen=True)
class Cell:
    first_page: int
    pages: int
    state: str
    inuse_pages: int
    reserved_pages: int
    used_blocks: int
    cached_blocks: int
    occupancy: float  # mean occupancy of the group's in-use pages (0..1)


@dataclass(frozen=True)
class PageCounts:
    """A whole map counted: pages by state and the blocks they hold."""

    inuse: int
    reserved: int
    blocks_used: int
    blocks_cached: int


_MAPPED_BYTE = bytes(1 if b & 0x80 else 0 for b in range(256))


def mapped_flags(entries: Sequence[int] | array) -> bytes | None:
    """One byte per page, 1 where the page is mapped, computed at C speed; None if ``entries`` is no u32 array.

    Lets a sparse 100k-page map be folded (or walked) in time proportional to its mapped pages.
    """
    if isinstance(entries, array) and entries.itemsize == 4 and sys.byteorder == "little":
        return entries.tobytes()[3::4].translate(_MAPPED_BYTE)  # bit 31 lives in each entry's 4th byte
    return None


def decoded(entries: Iterable[int]) -> list[tuple[bool, int, int]]:
    """Every page as (mapped, used blocks, cached blocks)."""
    return [L.decode_page(entry) for entry in entries]


def count_pages(entries: Iterable[int]) -> PageCounts:
    """In-use and reserved pages, used and cached blocks of a whole map."""
    mapped_bit, mask, shift = L.PAGE_MAPPED, L.PAGE_FIELD_MASK, L.PAGE_CACHED_SHIFT
    inuse = reserved = used = cached = 0
    for entry in entries:
        if entry & mapped_bit:
            u = entry & mask
            if u:
                inuse += 1
                used += u
                cached += (entry >> shift) & mask
            else:
                reserved += 1
    return PageCounts(inuse, reserved, used, cached)


def evictable_pages(entries: Sequence[int] | array | None) -> int:
    """In-use pages whose used blocks are all cached (evicting them empties the page).

    Walks only the mapped pages when the map is sparse, so a 65,536-page model that maps a few
    hundred costs a few hundred steps, not 65,536.
    """
    if entries is None:
        return 0
    mask, shift = L.PAGE_FIELD_MASK, L.PAGE_CACHED_SHIFT
    flags = mapped_flags(entries)
    if flags is None or flags.count(1) * 4 > len(entries):
        candidates: Iterable[int] = (e for e in entries if e & L.PAGE_MAPPED)
    else:
        candidates = (entries[i] for i in _mapped_indices(flags))
    count = 0
    for entry in candidates:
        used = entry & mask
        if used and used == (entry >> shift) & mask:
            count += 1
    return count


def _mapped_indices(flags: bytes) -> Iterator[int]:
    i = flags.find(1)
    while i >= 0:
        yield i
        i = flags.find(1, i + 1)


def occupancy_state(occupancy: float) -> str:
    if occupancy >= 1.0:
        return FULL
    if occupancy >= 2 / 3:
        return HIGH
    if occupancy >= 1 / 3:
        return MID
    return LOW


def fold(entries: Sequence[int] | array, blocks_per_page: int, cells: int, start: int = 0,
         pages_per_cell: int | None = None) -> list[Cell]:
    """Fold ``entries[start:]`` into at most ``cells`` cells.

    ``pages_per_cell`` fixes the zoom (1 = one page per cell); by default the whole map from
    ``start`` is fitted into ``cells``.
    """
    total = len(entries) - start
    if total <= 0 or cells <= 0:
        return []
    per = pages_per_cell or max(1, -(-total // cells))
    bpp = max(1, blocks_per_page)
    out: list[Cell] = []
    flags = mapped_flags(entries)
    for first in range(start, min(len(entries), start + per * cells), per):
        if flags is not None and flags.find(1, first, first + per) < 0:  # nothing mapped: free
            out.append(Cell(first, min(per, len(entries) - first), FREE, 0, 0, 0, 0, 0.0))
            continue
        counted = count_pages(entries[first:first + per])
        inuse, reserved = counted.inuse, counted.reserved
        used_sum, cached_sum = counted.blocks_used, counted.blocks_cached
        count = min(per, len(entries) - first)
        if inuse:
            occ = used_sum / (inuse * bpp)
            state = CACHED if cached_sum == used_sum else occupancy_state(occ)
        else:
            occ = 0.0
            state = RESERVED if reserved else FREE
        out.append(Cell(first, count, state, inuse, reserved, used_sum, cached_sum, occ))
    return out
