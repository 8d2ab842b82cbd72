"""Per-model history across refreshes: mapped bytes for the sparkline, and the allocation rate."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcached_core.snapshot import ModelSnapshot

DEPTH = 32


@dataclass
class _Track:
    mapped: deque = field(default_factory=lambda: deque(maxlen=DEPTH))
    read_ns: int = 0
    alloc_blocks: int = 0
    rate: float | None = None  # bytes allocated per second


class History:
    """Fed one scan per refresh. A repeated snapshot (same ``read_ns``) adds nothing."""

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}

    def update(self, models: Sequence[ModelSnapshot]) -> None:
        live = set()
        for m in models:
            live.add(m.name)
            track = self._tracks.setdefault(m.name, _Track())
            if m.read_ns and m.read_ns == track.read_ns:
                continue
            if track.read_ns and m.read_ns > track.read_ns:
                dt = (m.read_ns - track.read_ns) / 1e9
                grown = max(0, m.alloc_blocks - track.alloc_blocks)
                track.rate = grown * m.block_bundle_bytes / dt if not m.legacy else None
            track.read_ns, track.alloc_blocks = m.read_ns, m.alloc_blocks
            track.mapped.append(m.mapped_bytes)
        for gone in self._tracks.keys() - live:
            del self._tracks[gone]

    def mapped(self, name: str) -> list[int]:
        track = self._tracks.get(name)
        return list(track.mapped) if track else []

    def rate(self, name: str) -> float | None:
        track = self._tracks.get(name)
        return track.rate if track else None
