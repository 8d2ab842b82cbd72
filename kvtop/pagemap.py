"""Page-map cells: fold a model's page map into a fixed number of cells, faithfully.

Pure functions shared by ``kvctl show`` (characters) and the kvtop page-map widget (colours).
When there are more pages than cells, each cell covers a group of pages and shows the group's
dominant meaning: any in-use page makes the cell in use (with the group's mean occupancy of
its in-use pages), else any reserved page makes it reserved, else it is free. A cell whose
used blocks are all cached shows as cached.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvcached_core import layout as L

FREE, RESERVED, CACHED, LOW, MID, HIGH, FULL = "free", "reserved", "cached", "low", "mid", "high", "full"
STATES = (FREE, RESERVED, CACHED, LOW, MID, HIGH, FULL)
GLYPHS = {FREE: "·", RESERVED: "○", CACHED: "c", LOW: "░", MID: "▒", HIGH: "▓", FULL: "█"}
LEGEND = (
    (FREE, "free (unmapped)"), (RESERVED, "reserved (mapped, empty)"), (CACHED, "cached prefix only"),
    (LOW, "in use <34%"), (MID, "in use <67%"), (HIGH, "in use <100%"), (FULL, "full"),
)


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


_MAPPED_BYTE = bytes(1 if b & 0x80 else 0 for b in range(256))


def mapped_flags(entries: Sequence[int] | array) -> bytes | None:
    """One byte per page, 1 where the page is mapped, computed at C speed; None if ``entries`` is no u32 array.

    Lets a sparse 100k-page map be folded (or walked) in time proportional to its mapped pages.
    """
    if isinstance(entries, array) and entries.itemsize == 4 and sys.byteorder == "little":
        return entries.tobytes()[3::4].translate(_MAPPED_BYTE)  # bit 31 lives in each entry's 4th byte
    return None


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
    mapped_bit, mask, shift = L.PAGE_MAPPED, L.PAGE_FIELD_MASK, L.PAGE_CACHED_SHIFT
    flags = mapped_flags(entries)
    for first in range(start, min(len(entries), start + per * cells), per):
        if flags is not None and flags.find(1, first, first + per) < 0:  # nothing mapped: free
            out.append(Cell(first, min(per, len(entries) - first), FREE, 0, 0, 0, 0, 0.0))
            continue
        inuse = reserved = used_sum = cached_sum = 0
        for entry in entries[first:first + per]:
            if not entry & mapped_bit:
                continue
            used = entry & mask
            if used:
                inuse += 1
                used_sum += used
                cached_sum += (entry >> shift) & mask
            else:
                reserved += 1
        count = min(per, len(entries) - first)
        if inuse:
            occ = used_sum / (inuse * bpp)
            state = CACHED if cached_sum == used_sum else occupancy_state(occ)
        else:
            occ = 0.0
            state = RESERVED if reserved else FREE
        out.append(Cell(first, count, state, inuse, reserved, used_sum, cached_sum, occ))
    return out


def grid_lines(cells: list[Cell], width: int) -> list[str]:
    """Cells as rows of glyphs, ``width`` per row."""
    glyphs = "".join(GLYPHS[c.state] for c in cells)
    return [glyphs[i:i + width] for i in range(0, len(glyphs), max(1, width))]
