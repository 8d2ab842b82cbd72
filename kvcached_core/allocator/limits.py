"""A limit on a model's mapped bytes: applying it, its status, and the cached pages a deferred one evicts.

:class:`Limits` is one face of :class:`~kvcached_core.allocator.manager.KVCacheManager` (a base class of it): its
methods are the manager's own and keep their state on it (the C path reads ``limit_pages`` and ``limit_status``
there); it never imports the manager.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from ..segment import layout as L
from . import poller
from .parts import EvictHandler
from .placement import drain_victims
from .served import Served

INFLIGHT_WAIT_S = 1.0  # the most a limit waits for the refill thread's batch in flight to land
# (the process's poller serves the other allocators only after this: it stays well under a late heartbeat)


class _Limited(Served, Protocol):
    """What a limit reaches of the allocator."""

    requested_limit: int

    def _mapped_or_mapping(self) -> int: ...
    def _drop_cached(self, victims: list[int]) -> list[int]: ...
    def _evict_target(self) -> int | None: ...


class Limits:
    """The manager's limit methods (see the module docstring)."""

    limit_pages: int | None  # the limit in page bundles (None: no limit), set in the manager's __init__

    def set_limit(self: _Limited, limit_bytes: int | None) -> str:
        """Cap mapped bytes (rounded down to whole page bundles); returns applied, deferred or none."""
        problem = L.limit_problem(limit_bytes)
        if problem is not None:
            raise ValueError(problem)
        with self._lock:
            self._check_open()
            self._apply_limit(limit_bytes)
            self._publish()
            return L.LIMIT_STATUS_NAMES[self.limit_status]

    def set_evict_handler(self: _Limited, handler: EvictHandler | None) -> None:
        """Let a lowered limit take memory from the prefix cache: while the limit is deferred and whole cached
        pages hold it up, the allocator calls ``handler()`` (at once, then at every poller tick) and the engine
        answers with :meth:`evict_for_limit`. Without one a limit waits for the engine to evict. None removes it."""
        with self._lock:
            self._evict_handler = handler
            self.pressure.publish()  # whether it can give cached pages to another model's reclaim
            self._ask_evict()

    def evict_for_limit(self: _Limited) -> list[int]:
        """Under a deferred limit, or while another model's reclaim waits on this one (allocator/pressure.py),
        evict the cached blocks that keep it from its target: whole cached pages, cheapest first, no more pages
        than are over the target (``placement.drain_victims``); active blocks stay. Returns them: the engine
        drops them from its prefix index. [] when nothing waits on cached blocks (a look without the lock
        first: cheap enough for every engine step) or once closed."""
        if not self.cache.blocks or self._closed or (self.limit_status != L.LIMIT_DEFERRED
                                                     and self.pressure.give_target is None):
            return []
        with self._lock:
            target = self._evict_target()
            if self._closed or target is None:
                return []
            victims = self._drop_cached(drain_victims(self.cache, self.pages, target))
            if victims:
                self._update_limit_status()
                self._publish()
                if self.pressure.give_target is not None:  # a reclaim waits on these pages: answer it now
                    poller.poke(self.segment.wake_token)
            return victims

    def _evict_target(self: _Limited) -> int | None:
        """The pages a deferred limit or a reclaim under way evicts cached pages down to (the lower); None: neither."""
        targets = [t for t in (self.limit_pages if self.limit_status == L.LIMIT_DEFERRED else None,
                               self.pressure.give_target) if t is not None]
        return min(targets) if targets else None

    def _apply_limit(self: _Limited, limit_bytes: int | None) -> None:
        self.requested_limit = -1 if limit_bytes is None else limit_bytes
        if limit_bytes is None:
            self.limit_pages = None
            self.limit_status = L.LIMIT_NONE
            return
        self.limit_pages = limit_bytes // self.bundle_bytes
        self._unmap_excess()
        # Pages the refill thread is mapping right now are resident too: wait (bounded) for its
        # batch to land and give back what is over, so "applied" never hides memory in flight.
        deadline = time.monotonic() + INFLIGHT_WAIT_S
        while self.pages.inflight and self._mapped_or_mapping() > self.limit_pages and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break  # a stuck map: stays deferred, and the refill thread settles it when it lands
            self._update_limit_status()  # the wait lets go of the lock: what it leaves is published first
            self._publish()
            self._mapping_done.wait(left)
            self._unmap_excess()
        self._update_limit_status()
        self._ask_evict()

    def _ask_evict(self: _Limited) -> None:
        """A deferred limit that whole cached pages hold up: ask the engine's evict handler to evict them."""
        handler = self._evict_handler
        target = self._evict_target()
        if handler is None or self._closed or target is None:
            return
        if not drain_victims(self.cache, self.pages, target):
            return  # active blocks hold it up: nothing to ask until they go
        try:
            handler()
        except BaseException as exc:  # the limit stays deferred, as without a handler
            if not isinstance(exc, Exception) and not poller.on_poller_thread():
                raise  # SystemExit, KeyboardInterrupt: the engine's own thread's to handle (the poller's serves on)
            logging.getLogger(__name__).exception("%s: the engine's evict handler failed", self.name)

    def _unmap_excess(self: _Limited, *, newest: bool = False) -> None:
        """Unmap reserved pages until what is mapped (and being mapped) fits the limit, as far as pages allow."""
        if self.limit_pages is not None:
            excess = self._mapped_or_mapping() - self.limit_pages
            if excess > 0:
                self._unmap_reserved(excess, newest=newest)

    def _update_limit_status(self: _Limited) -> None:
        """applied only when everything resident, in flight included, fits the limit; else deferred."""
        if self.limit_pages is None:
            self.limit_status = L.LIMIT_NONE
        elif self.pages.pages_inuse > self.limit_pages or self._mapped_or_mapping() > self.limit_pages:
            self.limit_status = L.LIMIT_DEFERRED
        else:
            self.limit_status = L.LIMIT_APPLIED
