"""What an engine may admit: the blocks it can still take under the limit, the device and a shared budget.

:class:`Admission` is one face of :class:`~kvcached_core.allocator.manager.KVCacheManager` (a base class of it):
its methods are the manager's own and keep their state on it; it never imports the manager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..segment import layout as L
from .served import Served

log = logging.getLogger(__name__)


class _Admits(Served, Protocol):
    """What admission reaches of the allocator."""

    num_blocks: int
    _budget_short: bool
    _schedulable: int
    _room_handler: Callable[[], None] | None
    _room_wanted: bool
    room_wakes: int

    def _mapped_or_mapping(self) -> int: ...
    def available_size(self, *, device: bool = True) -> int: ...


class Admission:
    """The manager's admission methods (see the module docstring)."""

    def available_size(self: _Admits, *, device: bool = True) -> int:
        """Blocks that could still be allocated now, within the limit and the device's free memory.

        ``device=False`` leaves the device out (asking it can cost a system call or a directory
        scan): an engine that asks every step learns of a full device from ``alloc`` instead.
        """
        with self._lock:
            self._check_open()
            pages = self.pages
            in_mapped = pages.free_in_mapped()
            unmapped = pages.unmapped
            mappable = len(unmapped)
            if self.limit_pages is not None:
                mappable = min(mappable, max(0, self.limit_pages - self._mapped_or_mapping()))
            if device and mappable:
                mappable = min(mappable, self.backend.free_bytes() // self.bundle_bytes)
            # Pages map lowest id first and only the last page may hold fewer than blocks_per_page
            # blocks: it is among the next ``mappable`` pages only when they are all that is left.
            blocks = mappable * self.blocks_per_page
            last = len(pages.cap) - 1
            if mappable and mappable == len(unmapped) and pages.cap[last] != self.blocks_per_page \
                    and last in unmapped:
                blocks -= self.blocks_per_page - pages.cap[last]
            return in_mapped + blocks

    def max_blocks(self: _Admits) -> int:
        """The most blocks this model could ever hold: under its limit and within the device's budget, were every
        other model gone. An engine ends a request that needs more (it would wait, or be preempted, forever)."""
        pages = self.backend.capacity_bytes() // self.bundle_bytes
        if self.limit_pages is not None:
            pages = min(pages, self.limit_pages)
        return min(self.num_blocks, pages * self.blocks_per_page)

    def schedulable_blocks(self: _Admits, reserve: int = 0) -> int:
        """Blocks an engine may plan to take now: what ``alloc`` can give (the device left out, as in
        ``available_size(device=False)``) plus the cached blocks it may evict for them.

        Under a deferred limit, never more than the limit leaves beside the active blocks: an engine
        that admits work by this count (vLLM's scheduler) stops admitting and preempts until the
        model fits, so its pages drain and the limit applies, instead of refilling every hole.

        Under a budget shared with other models (``Backend.budget_free_bytes``), never more than that budget
        leaves beside what is mapped: the engine queues instead of admitting work it cannot map, and a model
        whose engine then waits with requests queued asks the others for memory (:meth:`publish_traffic`).
        ``reserve``: blocks of that budget kept back for the growth of the requests already running, when an
        engine admits a new one (vLLM's watermark, applied to the shared budget rather than to the model's
        virtual capacity), so that admitting it does not preempt them a few tokens later.

        The other models' warm pools (their reserved pages above their ``min``) count as room: a reclaim gives them
        first and at once. An alloc that needs them misses, and the refill thread asks for them
        (:mod:`.pressure`); once mapped, the room handler wakes the engine (:meth:`set_room_handler`).
        """
        with self._lock:
            # Pages the refill thread is mapping now are this model's (claimed already): counted, as they land soon;
            # without them a running request's growth at that moment found no room and was offloaded.
            inflight = self.pages.inflight * self.blocks_per_page
            free = self.available_size(device=False) + len(self.cache) + inflight
            if self.limit_status == L.LIMIT_DEFERRED and self.limit_pages is not None:
                active = self.pages.blocks_used - len(self.cache)
                free = min(free, max(0, self.limit_pages * self.blocks_per_page - active))
            budget = self.backend.budget_free_bytes()
            self._budget_short = False
            if budget is not None:
                ledger = getattr(self.backend, "ledger", None)  # the scan budget_free_bytes just counted
                if ledger is not None:
                    budget += ledger.takeable_bytes()
                room = max(0, self.pages.free_in_mapped() + len(self.cache) + inflight - reserve
                           + min(budget // self.bundle_bytes, self._headroom()) * self.blocks_per_page)
                if room < free:
                    free, self._budget_short = room, True
            self._schedulable = free
            return free

    # -- waking an engine that waits for room --------------------------------------------------------------
    def set_room_handler(self: _Admits, handler: Callable[[], None] | None) -> None:
        """``handler()`` is called, with no lock held, when room may have come for an engine whose admission was
        refused for room (:meth:`room_refused`): pages the refill thread mapped, a reclaim answered, another model's
        memory freed under the shared budget. An engine whose loop waits on a poll sets its wake-up there. None
        withdraws it."""
        self._room_handler = handler

    def room_refused(self: _Admits, refused: bool) -> None:
        """The engine's last scheduling pass held a waiting request back for room (True) or did not (False): while
        True, room coming calls the room handler. A plain write, no lock: an engine calls it every pass."""
        self._room_wanted = refused

    def _room_came(self: _Admits) -> bool:
        """Room may have come (no lock held): wake the engine if it waits for room; whether the handler ran."""
        handler = self._room_handler
        if handler is None or not self._room_wanted or self._closed:
            return False
        self.room_wakes += 1
        try:
            handler()
        except Exception:  # the engine's wake-up failed: it finds the room at its next poll
            log.exception("%s: the engine's room handler failed", self.name)
        return True
