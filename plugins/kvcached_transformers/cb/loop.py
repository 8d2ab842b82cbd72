"""Sleep, wake, limits and traffic for one continuous batching processor, served on its loop's thread.

transformers' generation loop calls ``ContinuousBatchProcessor.prepare_next_batch`` before every step,
and every 0.1 s while idle; :meth:`LoopControl.prepare_next_batch` wraps it, so everything that
changes the cache runs there, never from kvcached's poller thread:

- sleep (``kvctl sleep``, the after-idle policy): no new request is admitted, running ones finish,
  then every sector and the two trash sectors go back and ``sleep.ready()`` unmaps every page.
  ``sleep --now`` drains the same way (transformers has no way to preempt a request and keep its tokens).
  A request that arrives while the model sleeps wakes it, as ``kvctl wake`` does.
- a lowered limit, or another model's reclaim, that the cache holds up: the blocks transformers keeps
  for prefix sharing are evicted (its own ``evict_cached_blocks``), so their sectors go back.
- a limit or budget below what the waiting and running requests need: where transformers would stop
  with "No requests can be scheduled and no requests can be offloaded", the step is skipped and the
  requests wait until memory comes back (a limit raised, another model's requests ending).
- a request held back for room wakes the idle loop when room comes (kvcached's room handler sets the event the
  loop waits on for 0.1 s): the refill thread mapped pages, another model answered a reclaim.
- traffic (running, waiting, finished, tokens, offloads) is published for kvtop and kvctl whenever it changes, and on
  a GPU the engine's working memory (:mod:`.working`) whenever torch's figures change.
- the attention buffers follow each batch's reads (:mod:`.window`): fitted before the batch's tensors are built
  (``ContinuousBatchingIOs.prepare_batch_tensors``), back to one sector while the loop is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvcached_core.engines import LIMIT_DEFERRED

from .paged import KvcachedPagedAttentionCache
from .stats import AdmissionStats
from .working import WorkingMemory

log = logging.getLogger("kvcached_transformers.cb")


PUBLISH_EVERY_S = 0.05  # steps that change no figure publish this often (the idle clocks' activity)


class _Wait(Exception):  # a signal between two wrappers, never seen outside
    """Nothing can be scheduled and nothing offloaded: wait for memory instead of failing every request."""


class Traffic:
    """A model's request counters, kept across the processors it builds (the segment's counters only grow)."""

    def __init__(self) -> None:
        self.finished = self.prompt_tokens = self.generated_tokens = self.offloads = 0
        self.last_request_ns = 0
        self.admission = AdmissionStats()


class LoopControl:
    """Wraps one processor's ``prepare_next_batch``, ``schedule_batch``, ``finish_request`` and ``offload_requests``."""

    def __init__(self, cb_manager: Any, processor: Any, traffic: Traffic, working: WorkingMemory | None = None) -> None:
        cache = processor.cache
        assert isinstance(cache, KvcachedPagedAttentionCache)
        self.cache = cache
        self.manager = cache.kv_manager
        self.processor = processor
        self.scheduler = processor.scheduler
        self._wake_loop: threading.Event = cb_manager._wake_up_loop
        self._pending: str | None = None
        self._lock = threading.Lock()
        self.draining = False
        self.asleep = False
        self.traffic = traffic
        self.working = working
        self._read_budget = cache.read_budget  # the cached tokens the batch being built may read
        self._published: tuple[int, ...] = ()
        self._publish_due = 0.0  # when a step whose figures did not change publishes again
        self._nothing_scheduled = False
        self._waiting_logged = False

        self._prepare = processor.prepare_next_batch
        self._schedule = self.scheduler.schedule_batch
        self._finish_request = self.scheduler.finish_request
        offloader = processor.offloading_manager
        self._offload = offloader.offload_requests
        processor.prepare_next_batch = self.prepare_next_batch
        self.scheduler.schedule_batch = self.schedule_batch
        self.scheduler.finish_request = self.finish_request
        offloader.offload_requests = self.offload_requests
        self.io = processor.inputs_and_outputs
        if cache.window is not None:
            self._prepare_tensors = self.io.prepare_batch_tensors
            self.io.prepare_batch_tensors = self.prepare_batch_tensors
        self.attach_handlers()
        self.manager.set_evict_handler(self.evict_asked)

    def attach_handlers(self) -> None:
        """The loop (again) serves sleep requests, and wakes when room comes for the requests it holds back."""
        self.manager.set_sleep_handler(self.request)
        self.manager.set_room_handler(self._wake_loop.set)

    def detach(self) -> None:
        """The loop stopped: nobody serves a sleep or an eviction now, nor waits for room."""
        if not self.manager._closed:  # a manager closed first needs nothing
            self.manager.set_sleep_handler(None)
            self.manager.set_evict_handler(None)
            self.manager.set_room_handler(None)
            self.manager.room_refused(False)

    # -- kvcached's poller thread ----------------------------------------------------------------
    def request(self, action: str) -> None:
        """The sleep handler: record the action (the later wins) and wake the loop; the loop's thread serves it."""
        with self._lock:
            self._pending = action
        self._wake_loop.set()

    def evict_asked(self) -> None:
        """kvcached's evict handler (its lock held): a limit or a reclaim waits on cached blocks; the loop evicts."""
        self._wake_loop.set()

    # -- the loop's thread -------------------------------------------------------------------------
    def prepare_next_batch(self) -> bool:
        self.service()
        if self.asleep:
            if not self._arrivals():
                return False
            self.manager.sleep.wake()  # publishes awake; the handler's "wake" is served just below
            self.service()
        if self.draining:
            self.scheduler.block_new_requests = True
        self._nothing_scheduled = False
        try:
            ready = bool(self._prepare())
            self._waiting_logged = False
        except _Wait:
            ready = False
            if not self._waiting_logged:
                log.info("kvcached: %s waits for memory (%d requests)", self.manager.name, self._counts()[1])
                self._waiting_logged = True
        if self.draining:
            self._finish_drain()
        window = self.cache.window
        if not ready and window is not None and self._counts() == (0, 0):
            window.idle(self.io)
        self._publish(stepped=ready)
        return ready

    def prepare_batch_tensors(self, requests_in_batch: Any, logits_processors: Any, use_decode_fast_path: bool,
                              num_q_tokens: int, max_kv_read: int, use_padding: bool) -> None:
        """The window fitted to the batch's reads, then transformers builds the batch's tensors in it."""
        window = self.cache.window
        assert window is not None
        if not use_decode_fast_path:  # (the fast path reads through its block table)
            window.fit(self.io, max_kv_read, self._read_budget)
        self._prepare_tensors(requests_in_batch=requests_in_batch, logits_processors=logits_processors,
                              use_decode_fast_path=use_decode_fast_path, num_q_tokens=num_q_tokens,
                              max_kv_read=max_kv_read, use_padding=use_padding)

    def schedule_batch(self, token_budget: int, cache_budget: int) -> Any:
        """One scheduling pass: kvcached's room asked once for it, and its admissions counted (``Traffic.admission``).
        The cached tokens the batch may read: ``KvcachedPagedAttentionCache.pass_read_budget`` (``cache_budget``, what
        transformers passes, is the window's size: see .window)."""
        cache, scheduler = self.cache, self.scheduler
        active, waiting = scheduler.active_requests, scheduler.waiting_requests
        admitting = bool(waiting) or any(s.status.name != "DECODING" for s in active.values())
        self._read_budget = cache.pass_read_budget(scheduler)
        cache.begin_pass(active, admitting)
        try:
            result = self._schedule(token_budget, self._read_budget)
        finally:
            cache.end_pass()
        deferred = cache.deferred
        if deferred:  # their growth waits for room coming: not starved, so transformers does not offload them
            scheduler.starved_requests = [(s, n) for s, n in scheduler.starved_requests if s.request_id not in deferred]
        self._nothing_scheduled = result[0] is None
        refused = cache.refused
        if waiting and cache.free_share < getattr(scheduler, "safety_margin", 0.0):
            refused.add("margin")
        manager = self.manager
        # A request held back for room: kvcached wakes the loop when room comes (its refill mapped pages, a reclaim
        # was answered), instead of the loop finding it at its next 0.1 s poll.
        manager.room_refused(bool(deferred) or (bool(refused) and bool(waiting)))
        reserved = len(manager.pages.reserved) * manager.bundle_bytes
        pooled = getattr(manager.backend, "pooled_bytes", None)
        self.traffic.admission.count_pass(len(result[0] or ()), refused, reserved, pooled() if pooled else 0)
        return result

    def offload_requests(self) -> bool:
        done = bool(self._offload())
        if done:
            self.traffic.offloads += 1
        elif self._nothing_scheduled:
            raise _Wait
        return done

    def finish_request(self, request_id: str) -> None:
        state = self.scheduler.active_requests.get(request_id)
        self._finish_request(request_id)
        if state is not None and state.status.name == "FINISHED":
            traffic = self.traffic
            traffic.finished += 1
            traffic.prompt_tokens += len(state.initial_tokens)
            traffic.generated_tokens += len(state.generated_tokens)

    def service(self) -> None:
        """Serve a pending action, and evict prefix blocks a lowered limit or a reclaim waits on."""
        manager = self.manager
        if manager.limit_status == LIMIT_DEFERRED or manager.pressure.give_target is not None:
            self.cache.evict_for_kvcached()
        if self._pending is None:
            return
        with self._lock:
            action, self._pending = self._pending, None
        if action == "wake":
            if self.asleep:
                self.cache.take_trash()
            self.asleep = self.draining = False
            self.scheduler.block_new_requests = False
        elif action in ("sleep", "sleep_now"):
            self.scheduler.block_new_requests = True
            if self.asleep:  # asked again before a wake: unmap what was mapped since
                manager.sleep.ready()
            else:
                self.draining = True
                self._finish_drain()

    def _finish_drain(self) -> None:
        if self.scheduler.active_requests:
            return  # running requests finish first; their last step calls here again
        self.cache.release_all()
        if self.cache.window is not None:
            self.cache.window.idle(self.io)  # asleep, the attention buffers are one sector's too
        released = self.manager.sleep.ready()
        self.draining, self.asleep = False, True
        self._publish(stepped=False)
        log.info("kvcached: %s asleep, %d MiB of KV released", self.manager.name, released >> 20)

    def _arrivals(self) -> bool:
        queue = self.processor.input_queue
        return bool(self.scheduler.waiting_requests) or (queue is not None and not queue.empty())

    def _counts(self) -> tuple[int, int]:
        queue = self.processor.input_queue
        queued = queue.qsize() if queue is not None else 0
        return len(self.scheduler.active_requests), len(self.scheduler.waiting_requests) + queued

    def _waiting_sectors(self) -> int:
        per_sector = self.cache.tokens_per_sector_full
        return sum(-(-len(s.remaining_prefill_tokens) // per_sector) for s in self.scheduler.waiting_requests.values())

    def _publish(self, *, stepped: bool) -> None:
        """Traffic into the segment when it changed (a publish counts as activity: an idle loop publishes nothing);
        the working memory too, when its figures changed."""
        if self.working is not None and not self.manager._closed:
            self.working.publish(self.manager)
        running, waiting = self._counts()
        t = self.traffic
        figures = (running, waiting, t.finished, t.offloads)
        if figures == self._published and (not stepped or time.monotonic() < self._publish_due):
            return  # a step of the same figures publishes once per PUBLISH_EVERY_S: activity, not news
        self._publish_due = time.monotonic() + PUBLISH_EVERY_S
        if running + waiting > sum(self._published[:2]):
            t.last_request_ns = time.time_ns()
        self._published = figures
        if self.manager._closed:
            return
        self.manager.publish_traffic(running, waiting, t.finished, t.prompt_tokens, t.generated_tokens, t.offloads,
                                     t.last_request_ns, self._waiting_sectors() if waiting else 0)
