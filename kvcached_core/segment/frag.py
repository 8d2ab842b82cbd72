"""Fragmentation figures of one snapshot: what pages pin versus what blocks hold."""

from __future__ import annotations

from dataclasses import dataclass

from . import layout as L
from .snapshot import CompactInfo, ModelSnapshot


@dataclass(frozen=True)
class PageInfo:
    page: int
    used: int
    cached: int
    capacity: int

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


@dataclass(frozen=True)
class Fragmentation:
    held_bytes: int
    pinned_bytes: int
    waste_ratio: float | None
    packed_floor_pages: int
    packed_floor_bytes: int
    pinned_over_floor: float | None
    reclaimable_trim_bytes: int
    reclaimable_evict_bytes: int
    worst_pages: tuple[PageInfo, ...]
    idle_returned_bytes: int = 0  # what the allocator gave back on its own when traffic stopped
    compaction: CompactInfo | None = None  # what compaction moved and returned (None: unknown)

    def to_dict(self) -> dict:
        return {
            "held_bytes": self.held_bytes, "pinned_bytes": self.pinned_bytes,
            "waste_ratio": None if self.waste_ratio is None else round(self.waste_ratio, 4),
            "packed_floor_pages": self.packed_floor_pages, "packed_floor_bytes": self.packed_floor_bytes,
            "pinned_over_floor": None if self.pinned_over_floor is None else round(self.pinned_over_floor, 4),
            "reclaimable_trim_bytes": self.reclaimable_trim_bytes,
            "reclaimable_evict_bytes": self.reclaimable_evict_bytes,
            "idle_returned_bytes": self.idle_returned_bytes,
            "compaction": None if self.compaction is None else self.compaction.to_dict(),
            "worst_pages": [{"page": p.page, "used": p.used, "cached": p.cached,
                             "capacity": p.capacity} for p in self.worst_pages],
        }


def fragmentation(snap: ModelSnapshot, worst: int = 8) -> Fragmentation:
    """Held vs pinned, waste, packed floor, and what trim or eviction would give back.

    ``reclaimable_evict_bytes`` counts pages whose used blocks are all cached: evicting them
    empties the page. ``worst_pages`` (needs the page map) are in-use pages with the fewest used blocks.
    """
    bpp = snap.blocks_per_page or 1
    floor_pages = -(-snap.blocks_used // bpp) if snap.blocks_used else 0
    pinned_pages = snap.pages_inuse
    evict_pages = 0
    worst_pages: list[PageInfo] = []
    if snap.pages is not None:
        candidates = []
        for page, entry in enumerate(snap.pages):
            if not entry & L.PAGE_MAPPED:
                continue
            used = entry & L.PAGE_FIELD_MASK
            if not used:
                continue
            cached = (entry >> L.PAGE_CACHED_SHIFT) & L.PAGE_FIELD_MASK
            if cached == used:
                evict_pages += 1
            candidates.append((used, page, cached))
        candidates.sort()
        worst_pages = [PageInfo(p, u, c, bpp) for u, p, c in candidates[:worst]]
    return Fragmentation(
        held_bytes=snap.held_bytes, pinned_bytes=snap.pinned_bytes, waste_ratio=snap.waste_ratio,
        packed_floor_pages=floor_pages, packed_floor_bytes=floor_pages * snap.bundle_bytes,
        pinned_over_floor=pinned_pages / floor_pages if floor_pages else None,
        reclaimable_trim_bytes=snap.reserved_bytes,
        reclaimable_evict_bytes=evict_pages * snap.bundle_bytes,
        worst_pages=tuple(worst_pages),
        idle_returned_bytes=snap.idle_returned,
        compaction=snap.compaction,
    )
