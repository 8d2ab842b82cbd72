"""Sleep and wake for vLLM: the engine gives back its whole KV cache and takes it again.

The allocator's poller calls the handler (:meth:`Sleeper.request`) from its own thread; the
handler only records the action and pokes the EngineCore's busy loop (a ``WAKEUP`` on its input
queue), so the work happens on the engine's thread, between steps, where the scheduler is never
touched by two threads at once:

- sleep: the scheduler stops taking new requests (``PauseState.PAUSED_NEW``: they wait in its
  queue, none is rejected); ``sleep_now`` first preempts the running ones (vLLM recomputes them
  after waking). Once no request holds a block and no batch is in flight, the prefix cache is
  reset, the engine's placeholder block goes back too, and ``manager.sleep.ready()`` unmaps
  every page.
- wake (``kvctl wake``): the placeholder block is taken again and the scheduler runs what waited.
- the next request wakes the model by itself: one that arrives while it sleeps wakes it at once,
  and with it every request that waited (those that arrived while it drained, those ``sleep_now``
  preempted).

The same poke serves a lowered limit (``kvctl limit``) that cached blocks hold up: the allocator's evict
handler (:meth:`Sleeper.evict_asked`) pokes the loop, and :meth:`Sleeper.service`, on the engine's thread,
evicts the whole cached pages the limit needs through the block pool, so their hashes go first. It does so
at every step too (a look without a lock when no limit waits): a busy engine gives up its cache to the limit
as soon as requests end, an idle one within a poller tick.

Only the multiprocess engine (``EngineCoreProc``: ``vllm serve`` and ``vllm.LLM`` by default) has a
busy loop to poke; the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) registers no
handler, so ``kvctl sleep`` says that its engine cannot sleep, and a limit its cache holds up applies at its
next step, not while it is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .block_pool import KvcachedBlockPool

log = logging.getLogger(__name__)


class Sleeper:
    """The sleep state machine of one scheduler; every method but :meth:`request` runs on the engine's thread."""

    def __init__(self, scheduler: Any, pool: KvcachedBlockPool) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.manager = pool.manager
        self._pending: str | None = None  # the latest action asked, not yet served
        self._lock = threading.Lock()
        self._poke: Callable[[], None] | None = None
        self._core: Any = None
        self.draining = False
        self.asleep = False  # every block freed, pages unmapped (or about to be)

    def attach(self, core: Any, poke: Callable[[], None]) -> None:
        """The engine's busy loop is about to run: from now on the model can sleep."""
        self._core = core
        self._poke = poke
        self.manager.set_sleep_handler(self.request)
        self.manager.set_evict_handler(self.evict_asked)

    # -- the allocator's poller thread ---------------------------------------------------------
    def request(self, action: str) -> None:
        if action in ("sleep", "sleep_now"):
            # No new request is scheduled from now on, before the allocator answers "draining" (a plain
            # attribute write, safe from this thread; the engine's thread does the rest).
            from vllm.v1.core.sched.interface import PauseState

            self.scheduler.set_pause_state(PauseState.PAUSED_NEW)
        with self._lock:
            self._pending = action  # the later request wins
        poke = self._poke
        if poke is not None:
            poke()

    def evict_asked(self) -> None:
        """The allocator's evict handler: a lowered limit waits on cached blocks; :meth:`service` evicts them."""
        poke = self._poke
        if poke is not None:
            poke()

    # -- the engine's thread -------------------------------------------------------------------
    def service(self) -> None:
        """Serve an action asked for, evict what a lowered limit waits on, and finish a drain that can finish;
        cheap when there is nothing."""
        self.pool.evict_for_limit()
        if self._pending is not None:
            with self._lock:
                action, self._pending = self._pending, None
            if action == "wake":
                self._wake()
            elif action in ("sleep", "sleep_now"):
                self._begin(now=action == "sleep_now")
        if self.draining:
            self._finish()

    def arrived(self) -> None:
        """A request arrives: it wakes a sleeping model (one that arrives while the model drains waits)."""
        if self.asleep:
            self.manager.sleep.wake()  # publishes awake and calls request("wake")
            self.service()

    def _begin(self, *, now: bool) -> None:
        from vllm.v1.core.sched.interface import PauseState

        scheduler = self.scheduler
        scheduler.set_pause_state(PauseState.PAUSED_NEW)
        if self.asleep:  # asked again before a wake was served: nothing to drain, unmap what was mapped since
            self.manager.sleep.ready()
            return
        if now and scheduler.running:
            # As vLLM's reset_prefix_cache(reset_running_requests=True) does: every running request goes
            # back to the waiting queue without its blocks, to be recomputed after the wake.
            timestamp = time.monotonic()
            while scheduler.running:
                scheduler._preempt_request(scheduler.running.pop(), timestamp, drop_stale_output=True)
            scheduler.prev_step_scheduled_req_ids.clear()
            self._refresh_traffic()
        self.draining = True

    def _finish(self) -> None:
        manager, pool = self.manager, self.pool
        if self.scheduler.running or manager.used_blocks - manager.cached_blocks > pool.placeholders:
            return  # a request still holds blocks: its step frees them, and calls here again
        if self._core is not None and self._core.batch_queue:
            return  # a batch is still in flight
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():  # through vLLM's manager: its stats know
            return
        pool.release_placeholder()
        self.draining = False
        self.asleep = True
        released = manager.sleep.ready()
        self._refresh_traffic()
        log.info("kvcached: %s asleep, %d MiB of KV released", manager.name, released >> 20)

    def _refresh_traffic(self) -> None:
        traffic = self.scheduler.__dict__.get("_kvcached_traffic")
        if traffic is not None:
            traffic.refresh(self.scheduler.get_request_counts())

    def _wake(self) -> None:
        from vllm.v1.core.sched.interface import PauseState

        if self.asleep:
            self.pool.take_placeholder()
        self.asleep = self.draining = False
        self.scheduler.set_pause_state(PauseState.UNPAUSED)
