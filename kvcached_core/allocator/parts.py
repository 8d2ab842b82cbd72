"""What the allocator's parts use of it, as protocols: the parts (sleep, pressure, two-phase compaction, the
refill thread, the poller's serving) take the allocator as one of these instead of importing
:class:`~kvcached_core.allocator.manager.KVCacheManager`, so the manager stands above its parts and no import
runs back up. :class:`Allocator` is what sleep, pressure and two-phase compaction reach
(:class:`~kvcached_core.allocator.served.Served` adds what the refill thread and the poller's serving reach,
those parts included). The names with a leading
underscore are the allocator's own state and steps, shared with its parts, never with engines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..backends import Backend
    from ..segment.writer import SegmentWriter
    from .compact import CompactStats
    from .pages import PageTable
    from .placement import Policy
    from .prefix_cache import PrefixCache

# The engine's evict handler: a lowered limit is deferred while whole cached pages pin memory. Called with the
# allocator's lock held (from the poller or the thread that set the limit); it returns at once and has the
# engine call evict_for_limit() where its prefix index may change (its own thread, or under this lock).
EvictHandler = Callable[[], None]


class Allocator(Protocol):
    """What sleep, pressure and two-phase compaction reach of the allocator."""

    name: str
    block_bytes: int
    blocks_per_page: int
    bundle_bytes: int
    num_layers: int
    num_kv_buffers: int
    tp_world: int
    min_reserved: int
    max_reserved: int
    pages: PageTable
    cache: PrefixCache
    segment: SegmentWriter
    backend: Backend
    policy: Policy
    compaction: CompactStats
    _lock: threading.RLock
    _dirty: set[int]
    _closed: bool
    _evict_handler: EvictHandler | None

    def _check_open(self) -> None: ...
    def backend_mapped_bytes(self) -> int: ...
    def release_all(self) -> int: ...
    def _headroom(self) -> int: ...
    def _publish(self) -> None: ...
    def _unmap_reserved(self, count: int, *, newest: bool = False) -> int: ...
    def _release_blocks(self, blocks: list[int]) -> None: ...
    def _pack(self, *, compact: bool = True) -> list[int]: ...
    def _room_came(self) -> bool: ...
