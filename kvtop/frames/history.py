"""Per-model history across refreshes: mapped bytes for the sparkline, the allocation rate, and the
engine's traffic rates (requests and generated tokens per second, with a tok/s history)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcached_core import ModelSnapshot

DEPTH = 32


@dataclass
class _Track:
    mapped: deque = field(default_factory=lambda: deque(maxlen=DEPTH))
    read_ns: int = 0
    alloc_blocks: int = 0
    rate: float | None = None  # bytes allocated per second
    finished: int | None = None  # the engine's traffic counters at the last refresh (None: it publishes none)
    generated: int | None = None
    req_rate: float | None = None  # requests finished per second
    tok_rate: float | None = None  # tokens generated per second
    tokens: deque = field(default_factory=lambda: deque(maxlen=DEPTH))  # tok/s per refresh


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
                self._traffic_rates(track, m, dt)
            track.read_ns, track.alloc_blocks = m.read_ns, m.alloc_blocks
            if m.traffic is None:
                track.finished = track.generated = None
            else:
                track.finished, track.generated = m.traffic.finished, m.traffic.generated_tokens
            track.mapped.append(m.mapped_bytes)
        for gone in self._tracks.keys() - live:
            del self._tracks[gone]

    @staticmethod
    def _traffic_rates(track: _Track, m: ModelSnapshot, dt: float) -> None:
        t = m.traffic
        if t is None or track.finished is None or track.generated is None \
                or t.finished < track.finished or t.generated_tokens < track.generated:
            track.req_rate = track.tok_rate = None  # no figures, or the counters restarted (a new engine)
            return
        track.req_rate = (t.finished - track.finished) / dt
        track.tok_rate = (t.generated_tokens - track.generated) / dt
        track.tokens.append(track.tok_rate)

    def traffic_rates(self, name: str) -> tuple[float | None, float | None]:
        """(requests/s, tokens/s) between the last two refreshes; None where unknown."""
        track = self._tracks.get(name)
        return (track.req_rate, track.tok_rate) if track else (None, None)

    def tokens(self, name: str) -> list[float]:
        """tok/s at each recent refresh, oldest first (for the sparkline)."""
        track = self._tracks.get(name)
        return list(track.tokens) if track else []

    def mapped(self, name: str) -> list[int]:
        track = self._tracks.get(name)
        return list(track.mapped) if track else []

    def rate(self, name: str) -> float | None:
        track = self._tracks.get(name)
        return track.rate if track else None
