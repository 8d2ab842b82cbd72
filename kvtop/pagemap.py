"""Page-map cells for the screen: glyphs and legend over the core's folded cells.

The folding itself (and every page state) is :mod:`kvcached_core.segment.pagemap`, shared by ``kvctl show``
(characters) and the kvtop page-map widget (colours).
"""

from __future__ import annotations

from kvcached_core.segment.pagemap import (  # noqa: F401 - the cell API, as the screen modules import it
    CACHED,
    FREE,
    FULL,
    HIGH,
    LOW,
    MID,
    RESERVED,
    STATES,
    Cell,
    fold,
    mapped_flags,
    occupancy_state,
)

GLYPHS = {FREE: "·", RESERVED: "○", CACHED: "c", LOW: "░", MID: "▒", HIGH: "▓", FULL: "█"}
LEGEND = (
    (FREE, "free (unmapped)"), (RESERVED, "reserved (mapped, empty)"), (CACHED, "cached prefix only"),
    (LOW, "in use <34%"), (MID, "in use <67%"), (HIGH, "in use <100%"), (FULL, "full"),
)


def grid_lines(cells: list[Cell], width: int) -> list[str]:
    """Cells as rows of glyphs, ``width`` per row."""
    glyphs = "".join(GLYPHS[c.state] for c in cells)
    return [glyphs[i:i + width] for i in range(0, len(glyphs), max(1, width))]
