"""KVCacheManager: the elastic KV-cache allocator a serving engine calls."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral
from typing import Any

from ..backends import Backend, BackendError, Geometry, make_backend
from ..segment import layout as L
from ..segment.names import sanitize, segment_path, validate
from ..segment.writer import Identity, SegmentError, SegmentWriter, owned_stale
from ..settings import Settings
from ..settings import settings as process_settings
from ..tp.broadcast import BroadcastBackend
from ..tp.launch import adopt, spawn_workers
from . import fastpath, poller, refill, serving
from .admission import Admission
from .compact import CompactHandler, CompactStats
from .compact_staged import StagedCompaction
from .compacting import Compacting
from .limits import INFLIGHT_WAIT_S, Limits
from .pages import PageTable
from .parts import EvictHandler
from .placement import Policy, make_policy, place_draining
from .prefix_cache import PrefixCache
from .pressure import PressureControl
from .publishing import Publishing
from .sleep import SleepControl, SleepHandler


class KVCacheManager(Admission, Limits, Publishing, Compacting):
    """Hands out KV blocks from pages that are mapped on demand and returned when they empty.

    ``alloc`` never raises for exhaustion: it returns None when the limit or the device says
    no, with nothing changed. A background thread keeps the reserve pool between
    ``KVCACHED_MIN_RESERVED_PAGES`` and ``KVCACHED_MAX_RESERVED_PAGES`` so ``alloc`` rarely
    maps; a watcher thread applies limit and trim requests from other processes and answers
    them in the model's segment.

    Tensor parallelism: with ``tp_workers`` (one socket path per rank, see
    :mod:`kvcached_core.tp`) this manager is the model's scheduler; the geometry is one rank's
    shard, every map and unmap is broadcast to the ranks, and byte figures (page bundle,
    limit, mapped) count all ranks together.
    """

    def __init__(
        self,
        model: str,
        *,
        num_blocks: int,
        block_bytes: int,
        num_layers: int,
        num_kv_buffers: int = 2,
        page_size: int | None = None,
        backend: str = "host",
        device: int = 0,
        engine: str = "custom",
        block_tokens: int = 16,
        name: str | None = None,
        tp_rank: int = 0,
        tp_world: int = 1,
        tp_workers: Sequence[str] | None = None,
        tp_strategy: str | None = None,
        tp_timeout: float | None = None,
        policy: str | Policy | None = None,
        refill_linger_s: float | None = None,
        min_bytes: int | None = None,
        priority: int | None = None,
        settings: Settings | None = None,
    ) -> None:
        # Every default below, and the backend's, come from ``settings`` (the process's environment, read once,
        # when None): a test or an embedding passes its own instead of changing os.environ.
        cfg = self.settings = process_settings() if settings is None else settings
        page_size = cfg.page_size_bytes if page_size is None else page_size
        for label, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes),
                             ("num_layers", num_layers), ("num_kv_buffers", num_kv_buffers),
                             ("page_size", page_size), ("block_tokens", block_tokens)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if block_bytes > page_size:
            fit = -(-block_bytes // (2 * 1024 * 1024)) * 2
            raise ValueError(
                f"a block of {block_bytes} bytes does not fit a page of {page_size} bytes: "
                f"use page_size >= {block_bytes} (KVCACHED_PAGE_SIZE_MB={fit} fits)"
            )
        if tp_workers is not None and tp_world == 1:
            tp_world = len(tp_workers)
        if tp_world < 1 or (tp_world > 1 or tp_workers is not None) and len(tp_workers or ()) != tp_world:
            raise ValueError(f"tp_world={tp_world} needs one worker socket per rank in tp_workers "
                             f"(got {len(tp_workers or ())}); see KVCacheManager.tensor_parallel()")
        bpp = page_size // block_bytes  # blocks never straddle pages; a page's tail may go unused
        if bpp > L.MAX_BLOCKS_PER_PAGE:
            raise ValueError(f"{bpp} blocks per page exceeds {L.MAX_BLOCKS_PER_PAGE}: use larger blocks or smaller pages")
        self.model = model
        self.engine = engine
        self.block_bytes = block_bytes
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_buffers = num_kv_buffers
        self.num_blocks = num_blocks
        self.blocks_per_page = bpp
        self.block_tokens = block_tokens
        # How long the refill thread keeps polling after traffic (refill.REFILL_LINGER_S); 0: it sleeps until an
        # alloc wakes it, for engines whose steps are long next to a wake-up (vLLM's scheduler).
        if refill_linger_s is not None and (not isinstance(refill_linger_s, (int, float)) or refill_linger_s < 0):
            raise ValueError(f"refill_linger_s must be a number of seconds >= 0, got {refill_linger_s!r}")
        self.refill_linger_s = refill.REFILL_LINGER_S if refill_linger_s is None else refill_linger_s
        pages_total = -(-num_blocks // bpp)
        if pages_total > L.MAX_PAGES:
            raise ValueError(f"{num_blocks} blocks of {block_bytes} bytes make {pages_total} pages of {page_size} bytes, "
                             f"more than a segment's {L.MAX_PAGES}: use larger pages (KVCACHED_PAGE_SIZE_MB)")
        self.geometry = Geometry(page_size, pages_total, num_layers, num_kv_buffers)
        self.tp_world = tp_world
        self.bundle_bytes = self.geometry.bundle_bytes * tp_world  # one page id on every rank
        bounds = cfg.reserve
        self.min_reserved, self.max_reserved = bounds.min_pages, bounds.max_pages
        fast_mode = cfg.mode(fastpath.FASTPATH_ENV)
        fastpath.require(fast_mode)  # KVCACHED_FASTPATH=1 without a build fails before any file exists

        self._lock = threading.RLock()
        self._refill_wanted = threading.Condition(self._lock)
        self._mapping_done = threading.Condition(self._lock)  # the refill thread finished a batch
        self._closed = False
        self.pages = PageTable(pages_total, bpp, num_blocks)
        self.policy = make_policy(cfg.policy if policy is None else policy)
        self.cache = PrefixCache(bpp, cfg.cached_blocks(block_tokens))
        if tp_workers is not None:
            self.backend: Backend = BroadcastBackend(self.geometry, backend, tp_workers, strategy=tp_strategy,
                                                     timeout=tp_timeout, settings=cfg)
        else:
            self.backend = make_backend(backend, self.geometry, device, settings=cfg)
        try:
            seg_name = self._choose_name(name, model, cfg)
            self.segment = SegmentWriter(Identity(
                name=seg_name, model=model, engine=engine, backend=self.backend.name, device=self.backend.device,
                page_size=page_size, block_bytes=block_bytes, num_layers=num_layers,
                num_kv_buffers=num_kv_buffers, blocks_per_page=bpp, num_blocks=num_blocks,
                pages_total=pages_total, tp_rank=tp_rank, tp_world=tp_world,
                ranks_max=max(1, tp_world), device_capacity=self.backend.capacity_bytes(),
                device_headroom=self.backend.headroom_bytes(),
            ), cfg.shm_dir)
        except BaseException:
            self.backend.close()
            raise
        self.name = self.segment.ident.name
        self.backend.bind_claims(self.segment.set_claimed, self.segment.inode)

        # Counters published with every state change.
        self.alloc_count = self.free_count = self.alloc_blocks = self.free_blocks = 0
        self.evicted_blocks = self.trimmed_total = self.idle_returned = 0
        self.traffic_published = 0  # publish_traffic calls: an engine stepping (decoding) is not idle
        self.limit_pages: int | None = None
        self.limit_status = L.LIMIT_NONE
        self.requested_limit = -1
        self.applied_revision = 0
        self.trim_ack_seq = 0
        self.trim_bytes = 0
        self._dirty: set[int] = self.pages.touched  # pages to publish; take_blocks adds its own
        self._map_error: BackendError | None = None  # see _raise_map_error
        self._refill_requested = False  # set by traffic; a trim or an idle model stays trimmed
        self._refill_polling = False  # the refill thread looks by itself: no need to wake it
        self._budget_short = False  # schedulable_blocks found the shared budget, not the limit, holding it back
        self._schedulable = 0  # schedulable_blocks' last answer
        self._room_handler: Callable[[], None] | None = None  # set_room_handler: wakes an engine waiting for room
        self._room_wanted = False  # room_refused: the engine's last pass held a request back for room
        self.room_wakes = 0  # room handler calls
        self.sleep = SleepControl(self)  # sleep and wake (kvcached_core.allocator.sleep)
        self._compact_handler: CompactHandler | None = None  # the engine's copy (see compact)
        self._evict_handler: EvictHandler | None = None  # see set_evict_handler
        self.compaction = CompactStats()  # the segment's COMPACT words
        self.staged = StagedCompaction(self)  # two-phase compaction (set_compact_poke)
        # Memory pressure between the models of a device (kvcached_core.allocator.pressure): min and priority
        # from the arguments, else KVCACHED_MIN / KVCACHED_PRIORITY; kvctl policy changes them live.
        self.pressure = PressureControl(self, cfg.min_bytes if min_bytes is None else min_bytes,
                                        cfg.priority if priority is None else priority)
        self._fast: Any = None  # the C path, attached below (fastpath.attach): it publishes too
        self._publish()
        self.segment.publish_compaction(self.compaction.values())
        endpoint = cfg.endpoint  # KVCACHED_ENDPOINT: an engine's server says where it serves
        if endpoint is not None:
            self.segment.publish_endpoint(endpoint)
        try:
            self._fast, self.fastpath_reason = fastpath.attach(self, self.policy, fast_mode)
            if self._fast is not None and type(self).alloc is KVCacheManager.alloc:
                # This instance's alloc becomes the C one, lock and all: right after an engine's GPU
                # wait the Python around the placement cost more than the placement itself
                # (benchmarks/probes/alloc_stages.py). It hands to the method below what it does not serve.
                # A subclass that overrides alloc keeps its own (the C path still serves its super() calls).
                self.alloc = self._fast.manager_alloc  # type: ignore[method-assign]
        except BaseException:
            self.backend.close()
            self.segment.close(unlink=True)
            raise

        me = weakref.ref(self)  # never a strong reference from a thread: see refill.loop
        self._threads = [
            threading.Thread(target=refill.loop, args=(me,), name=f"kvc-refill-{self.name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        # Controls, idle return and the heartbeat: the process's one poller thread (see kvcached_core.allocator.poller).
        self._watch = poller.register(self, self.segment.wake_token, serving.tick, serving.WatchState(cfg.idle_return_s))

    @classmethod
    def tensor_parallel(cls, model: str, *, world: int, backend: str = "host", devices: Sequence[int] | None = None,
                        strategy: str | None = None, timeout: float | None = None,
                        worker_capacity: int | Sequence[int | None] | None = None,
                        **kwargs: Any) -> KVCacheManager:
        """A tensor-parallel manager with ``world`` freshly started rank workers (``kvcached_core.tp``).

        The manager owns the workers: ``close()`` tells them to release their memory and waits for them.
        ``kwargs`` are the usual geometry and naming arguments (``num_blocks``, ``block_bytes`` per rank,
        ``num_layers``, ...). An engine that starts its own workers passes ``tp_workers=[socket paths]``.
        """
        group = spawn_workers(world, backend=backend, devices=devices, capacity=worker_capacity, label=model)
        try:
            manager = cls(model, backend=backend, tp_world=world, tp_workers=group.paths,
                          tp_strategy=strategy, tp_timeout=timeout, **kwargs)
        except BaseException:
            group.kill()
            raise
        adopt(manager.backend, group)  # type: ignore[arg-type]
        return manager

    @staticmethod
    def _choose_name(name: str | None, model: str, cfg: Settings) -> str:
        explicit = name if name is not None else cfg.ipc_name
        if explicit is not None:  # an explicit empty name is refused, not replaced by the default
            return validate(explicit)
        base = sanitize(model)
        path = segment_path(base, cfg.shm_dir)
        if not path.exists() or owned_stale(path):  # our own dead segment is replaced on create
            return base
        return f"{base[:50]}-{os.getpid()}"

    # -- engine API --------------------------------------------------------------------------
    def alloc(self, n: int, *, near: int | None = None) -> list[int] | None:
        """``n`` block ids, kept together on as few pages as possible; None if the limit or device says no.

        ``near``: a block the same request already holds (its last one), so the policy can keep
        the request's blocks on the same pages; a hint, never required.
        """
        if n <= 0:
            return []
        with self._lock:
            if self._closed:
                self._check_open()
            self._map_error = None
            fast = self._fast
            if fast is not None and (near is None or type(near) is int):
                ids = fast.alloc(n, near)  # places, counts and publishes, as below
            else:
                ids = self._place(n, near)
                if ids is not None:
                    self.alloc_count += 1
                    self.alloc_blocks += n
                    self._publish()
            if ids is None:
                self._alloc_missed(n)
                return None
            if len(self.pages.reserved) + self.pages.inflight < self.min_reserved:
                self._refill_requested = True
                if not self._refill_polling:
                    self._refill_wanted.notify()
            return ids

    def register_working_memory(self, peak_bytes: int, now_bytes: int | None = None) -> None:
        """The engine's measured working-memory peak beside its weights and KV (activations, masks, logits: a
        profiling pass at its largest batch), and of it what its process holds now (torch's caching allocator
        keeps what it once reached; None: nothing yet). Published in the segment; every CUDA allocator of the
        device keeps ``max(0, peak - now)`` free beside the headroom, so KV never takes what a forward pass
        needs (``KVCACHED_DEVICE_HEADROOM``, docs/cuda.md). Call it again whenever either figure changes."""
        now = 0 if now_bytes is None else now_bytes
        for label, value in (("peak_bytes", peak_bytes), ("now_bytes", now)):
            if not isinstance(value, Integral) or isinstance(value, bool) or not 0 <= value <= L.MAX_LIMIT_BYTES:
                raise ValueError(f"{label} must be a whole number of bytes from 0 to 2^63-1, got {value!r}")
        with self._lock:
            self._check_open()
            self.segment.set_working(int(peak_bytes), int(now))

    def _shortfall_bytes(self, blocks: int) -> int:
        """Bytes to map before ``blocks`` more blocks fit (lock held): whole page bundles, at least one."""
        lacking = max(1, blocks - self.pages.free_in_mapped())
        return -(-lacking // self.blocks_per_page) * self.bundle_bytes

    def _alloc_missed(self, n: int) -> None:
        """alloc(n) found no pages: report a map failure if there was one, else publish; the miss is None.

        When the shared budget refused a page of it, the model asks the others for all that ``n`` lacks, not for
        that one page (a reclaim each page would make a large request wait for many rounds)."""
        if self.pressure.wanted:
            self._refused(self._shortfall_bytes(n))
        self._raise_map_error()  # publishes first when it raises
        self._publish()  # the roll-back may have mapped or unmapped pages
        return None

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks (active or cached). Unknown or repeated ids raise ValueError and change nothing."""
        ids = list(ids)
        with self._lock:
            if self._closed:
                self._check_open()
            fast = self._fast
            if fast is not None and fast.free(ids):  # all of the below, in C (False: ids that are not ints)
                return
            self._validate_used(ids)
            cache = self.cache
            if cache.blocks:
                for block in ids:
                    if block in cache:
                        cache.remove(block)
            self._release_blocks(ids)
            self.free_count += 1
            self.free_blocks += len(ids)
            self._publish()

    def try_to_reserve(self, n: int) -> bool:
        """Make sure ``n`` blocks can be allocated without mapping; maps now if needed."""
        with self._lock:
            self._check_open()
            short = n - self.pages.free_in_mapped()
            if short <= 0:
                return True
            pages = -(-short // self.blocks_per_page)
            self._map_error = None
            self._grow(pages)
            self._publish()
            self._raise_map_error()
            return self.pages.free_in_mapped() >= n  # the last page may hold fewer blocks

    def free_reserved(self) -> int:
        """Shrink the reserve pool back to its minimum; returns bytes unmapped."""
        with self._lock:
            self._check_open()
            surplus = len(self.pages.reserved) - self.min_reserved
            freed = self._unmap_reserved(surplus) if surplus > 0 else 0
            self._publish()
            return freed

    def trim(self) -> int:
        """Unmap every reserved page now; returns the bytes given back."""
        with self._lock:
            self._check_open()
            freed = self._unmap_reserved(len(self.pages.reserved))
            self.backend.trim_pool(0)
            self.trimmed_total += freed
            self._publish()
            return freed

    def set_sleep_handler(self, handler: SleepHandler | None) -> None:
        """Declare that this engine can sleep (see :mod:`kvcached_core.allocator.sleep`); None withdraws it."""
        self.sleep.set_handler(handler)

    def backend_mapped_bytes(self) -> int:
        """Bytes mapped now (every mapped page bundle)."""
        return self.pages.mapped_pages * self.bundle_bytes

    def release_all(self) -> int:
        """Unmap every page no block is on and return the backend's pool: what sleep does once the engine
        holds nothing. Returns the bytes unmapped."""
        with self._lock:
            self._check_open()
            self._refill_requested = False
            freed = self._unmap_reserved(len(self.pages.reserved))
            deadline = time.monotonic() + INFLIGHT_WAIT_S  # a refill batch in flight lands, then goes too
            while self.pages.inflight and not self._closed and time.monotonic() < deadline:
                self._publish()  # the wait lets go of the lock: what it leaves is published first
                self._mapping_done.wait(max(0.0, deadline - time.monotonic()))
                freed += self._unmap_reserved(len(self.pages.reserved))
            self.backend.trim_pool(0)
            self._publish()
            return freed

    # -- prefix cache ------------------------------------------------------------------------
    def mark_cached(self, ids: Iterable[int]) -> list[int]:
        """Blocks stay allocated but become evictable; returns cached blocks evicted to keep the budget."""
        ids = list(ids)
        with self._lock:
            self._check_open()
            self._validate_used(ids)
            for block in ids:
                if block not in self.cache:
                    self.cache.add(block)
                    self._dirty.add(block // self.blocks_per_page)
            evicted = self._evict(self.cache.over_budget())
            if self.pages.blocks_used == len(self.cache) and not self.staged.defer_pack():
                # nothing active: the model just went idle (a two-phase engine compacts first, then packs)
                # Compaction may fill the slots just evicted: the engine learns those ids as destinations
                # (its handler drops what it still records for them), so they are not returned as evicted.
                refilled = self._compact_idle()
                if refilled:
                    evicted = [b for b in evicted if b not in refilled]
                evicted += self._pack(compact=False)
            self._publish()
            return evicted

    def pack(self) -> list[int]:
        """Give back cached blocks of the emptiest pages so the model pins close to its packed floor.

        What the policy does by itself when the last active block goes (see ``mark_cached``);
        engines may also call it when they go idle. Returns the evicted blocks: drop them from
        the prefix index. Nothing moves; the emptied pages are unmapped at once.
        """
        with self._lock:
            self._check_open()
            evicted = self._pack()
            self._publish()
            return evicted

    @property
    def lock(self) -> threading.RLock:
        """The allocator's lock (re-entrant). A compact handler runs while it is held, so an engine whose
        thread reads the prefix index a handler rewrites holds it from the lookup to its ``reuse``."""
        return self._lock

    def reuse(self, ids: Iterable[int]) -> None:
        """A prefix hit: cached blocks go back into active use."""
        ids = list(ids)
        with self._lock:
            self._check_open()
            missing = [b for b in ids if b not in self.cache]
            claimed = self.staged.claim(missing) if missing else set()  # destinations of a compaction in flight
            if claimed:
                missing = [b for b in missing if b not in claimed]
            if missing:
                raise ValueError(f"blocks not in the prefix cache: {missing[:8]}")
            if len(set(ids)) != len(ids):
                raise ValueError("a block is listed twice; nothing was changed")
            for block in ids:
                if block in claimed:
                    continue
                self.cache.remove(block)
                self._dirty.add(block // self.blocks_per_page)
            if claimed:
                ticket = self.staged.ticket
                assert ticket is not None
                ticket.reused.update(claimed)
            self._publish()

    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` cached blocks of the allocator's choosing (whole pages first)."""
        with self._lock:
            self._check_open()
            evicted = self._evict(n)
            self._publish()
            return evicted

    @property
    def cached_blocks(self) -> int:
        return len(self.cache)

    def cached_block_ids(self) -> list[int]:
        """The cached blocks (``mark_cached``, not reused or evicted since), oldest first: a copy."""
        with self._lock:
            return list(self.cache.blocks)

    @property
    def used_blocks(self) -> int:
        return self.pages.blocks_used

    def buffer(self, layer: int, kv: int):  # backend-specific view
        """The backend's view of one layer's one KV buffer (host: a writable memoryview)."""
        return self.backend.buffer(layer, kv)  # type: ignore[attr-defined]

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the threads, unmap everything and unlink the segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fast = None  # it holds the manager: drop the cycle
            self.__dict__.pop("alloc", None)  # the C alloc goes with it
            self._refill_wanted.notify_all()
        poller.unregister(self._watch)  # no tick of ours runs after this
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2)
        with self._lock:
            self.backend.close()
            self.segment.close(unlink=True)

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: never leave a segment behind
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- internals (lock held) ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KVCacheManager {self.name!r} is closed")

    def _validate_used(self, ids: list[int]) -> None:
        seen: set[int] = set()
        for block in ids:
            if not isinstance(block, (int, Integral)) or not self.pages.is_used(block) or block in seen:
                raise ValueError(f"block {block!r} is not allocated (or listed twice); nothing was changed")
            seen.add(block)

    def _raise_map_error(self) -> None:
        """A map failed (a device error, a lost tensor-parallel rank): publish what is known, then raise it."""
        error, self._map_error = self._map_error, None
        if error is not None:
            self._publish()
            raise error

    def _mapped_or_mapping(self) -> int:
        return self.pages.mapped_pages + self.pages.inflight

    def _headroom(self) -> int:
        """Pages that may still be mapped under the limit."""
        if self.limit_pages is None:
            return len(self.pages.unmapped)
        return max(0, min(len(self.pages.unmapped), self.limit_pages - self._mapped_or_mapping()))

    def _grow(self, count: int) -> int:
        """Map ``count`` pages synchronously (a pool miss or try_to_reserve); returns pages mapped."""
        count = min(count, self._headroom())
        if count <= 0:
            return 0
        if self.sleep.state == L.SLEEP_ASLEEP:  # asleep means nothing mapped: an alloc that needs a page wakes it
            self.sleep.alloc_woke()
        asked = self.pages.take_unmapped(count)
        mapped: list[int] = []
        try:
            mapped = self.backend.map_pages(asked)
        except BackendError as exc:  # not a short answer: a miss now, raised once placement rolled back
            self._map_error = exc
        self.pages.finish_mapping(asked, mapped)
        self._dirty.update(mapped)
        if len(mapped) < len(asked) and self._map_error is None and not self.pages.inflight:
            # refused by the budget, not by this model's own refill in flight (its pages land soon)
            self._refused((len(asked) - len(mapped)) * self.bundle_bytes)
        elif mapped:
            self.pressure.satisfied()
        return len(mapped)

    def _refused(self, nbytes: int) -> None:
        """The device's budget refused a growth of ``nbytes`` (lock held): the refill thread asks the other
        models of the device for them (allocator/pressure.py); this thread never waits for it."""
        self.pressure.note_refused(nbytes)
        self._refill_requested = True
        if not self._refill_polling:
            self._refill_wanted.notify()

    def _empty_page(self) -> int | None:
        page = self.pages.take_reserved()
        if page is None and self._grow(1):
            page = self.pages.take_reserved()
        return page

    def _place(self, n: int, near: int | None = None) -> list[int] | None:
        taken: list[int] = []
        if self.limit_status == L.LIMIT_DEFERRED:
            ok = place_draining(self.pages, n, taken)
        else:
            ok = self.policy.place(self.pages, n, self._empty_page, taken, near)
        if not ok:
            self._release_blocks(taken)  # roll back: nothing changes on a miss
            return None
        return taken

    def _release_blocks(self, blocks: list[int]) -> None:
        """Give slots back; pages that empty join the pool (up to its maximum and the limit) or are unmapped."""
        if not blocks:
            return
        touched = self.pages.free_blocks(blocks)
        self._dirty.update(touched)
        used = self.pages.used
        for page in touched:
            if used[page] == 0:
                self.pages.reserved.append(page)
                over_limit = self.limit_pages is not None and self._mapped_or_mapping() > self.limit_pages
                if over_limit or len(self.pages.reserved) > self.max_reserved:
                    self._pool_overflow()
                if self.limit_status == L.LIMIT_DEFERRED:
                    self._update_limit_status()

    def _pool_overflow(self) -> None:
        """A page just joined a pool that is full (or the model is over its limit): unmap the newest."""
        self._unmap_reserved(1, newest=True)

    def _unmap_reserved(self, count: int, *, newest: bool = False) -> int:
        if count <= 0:
            return 0
        if newest:
            victims = [self.pages.reserved.pop() for _ in range(min(count, len(self.pages.reserved)))]
        else:
            victims = self.pages.release_reserved(count)
        if not victims:
            return 0
        self.backend.unmap_pages(victims)
        self.pages.mark_unmapped(victims)
        self._dirty.update(victims)
        return len(victims) * self.bundle_bytes

    def _evict(self, n: int) -> list[int]:
        victims = self.policy.victims(self.cache, n, self.pages)
        return self._drop_cached(victims)

    def _drop_cached(self, victims: list[int]) -> list[int]:
        for block in victims:
            self.cache.remove(block)
        self._release_blocks(victims)
        self.evicted_blocks += len(victims)
        return victims

    def _pack(self, *, compact: bool = True) -> list[int]:
        """Idle packing: compact first (when the engine can, see ``_compact_idle``), then evict what the policy's
        idle packing still picks. The pages emptied are unmapped, not pooled."""
        pages = self.pages
        if compact:
            if self.staged.defer_pack():
                return []
            self._compact_idle()
        mapped_before = pages.mapped_pages
        victims = self._drop_cached(self.policy.pack(self.cache, pages))
        if victims:
            bpp = self.blocks_per_page
            emptied = {b // bpp for b in victims}
            pool = [p for p in pages.reserved if p in emptied]
            if pool:
                pages.reserved[:] = [p for p in pages.reserved if p not in emptied]
                self.backend.unmap_pages(pool)
                pages.mark_unmapped(pool)
                self._dirty.update(pool)
            self.idle_returned += (mapped_before - pages.mapped_pages) * self.bundle_bytes
        return victims


__all__ = ["KVCacheManager", "SegmentError"]
