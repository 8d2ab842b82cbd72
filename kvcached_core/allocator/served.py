"""What the refill thread (:mod:`.refill`) and the poller's serving (:mod:`.serving`) use of the allocator:
:class:`~kvcached_core.allocator.parts.Allocator` and the limit, trim and refill state, and the other parts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .parts import Allocator

if TYPE_CHECKING:
    from .compact import CompactHandler, CompactResult
    from .compact_staged import StagedCompaction
    from .pressure import PressureControl
    from .sleep import SleepControl


class Served(Allocator, Protocol):
    """What the refill thread and the poller's serving reach besides: the limit, trim and refill state, and
    the other parts."""

    alloc_count: int
    free_count: int
    traffic_published: int
    limit_pages: int | None
    limit_status: int
    applied_revision: int
    trim_ack_seq: int
    trim_bytes: int
    trimmed_total: int
    idle_returned: int
    refill_linger_s: float
    sleep: SleepControl
    pressure: PressureControl
    staged: StagedCompaction
    _compact_handler: CompactHandler | None
    _room_handler: Callable[[], None] | None
    _room_wanted: bool
    _refill_requested: bool
    _refill_polling: bool
    _refill_wanted: threading.Condition
    _mapping_done: threading.Condition

    def _apply_limit(self, limit_bytes: int | None) -> None: ...
    def _ask_evict(self) -> None: ...
    def _compact(self) -> CompactResult: ...
    def _unmap_excess(self, *, newest: bool = False) -> None: ...
    def _update_limit_status(self) -> None: ...
