"""transformers' paged attention cache with its sectors in kvcached pages.

transformers' continuous batching keeps its KV cache in one flat byte tensor cut into *sectors*
(``bytes_per_sector``, the least common multiple of its allocators' block sizes); sector ``s`` is
bytes ``[s * bytes_per_sector, (s + 1) * bytes_per_sector)``, and sectors 0 and 1 are trash that
padding tokens read (zeros) and write. Here:

- the tensor is a view over a :class:`~kvcached_core.KVCacheManager`'s range (one layer, one buffer,
  one kvcached block per sector, pages a whole number of sectors), so sector ``s`` is kvcached block
  ``s`` and only the pages of sectors in use are mapped;
- a sector is taken with ``alloc`` and given back with ``free`` the moment no block of it is in use
  (transformers keeps emptied sectors until its scheduler asks; kvcached gets them at once);
- the free count the scheduler admits by is ``schedulable_blocks``, asked once per scheduling pass
  (:meth:`KvcachedPagedAttentionCache.begin_pass`; the sectors the pass takes and gives back are counted on it): the
  limit, a shared budget and other models' memory bound it, and each pass sees what the others freed;
- a new request is admitted beside the growth running requests can still need (:meth:`~KvcachedPagedAttentionCache.
  growth_reserve`), and transformers' FIFO safety margin is taken over what the model holds plus what it may take,
  not over its whole address space (:meth:`~KvcachedPagedAttentionCache.compute_free_capacity`);
- the two trash sectors are any two kvcached blocks (zeroed), the allocators' trash indices point at them;
- the attention buffers transformers sizes by the capacity (for an elastic model, the whole budget it shares) follow
  what each batch reads instead (:mod:`.window`).

The upstream ``__init__`` sizes the cache unchanged over a ``meta`` tensor (no memory); then the
allocators are registered again over the kvcached view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from math import lcm
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import CachePool
from transformers.generation.continuous_batching.cache_allocators.cache_pool import RegularTrees

from kvcached_core import KVCacheManager
from kvcached_core.settings import settings

from ..pools import page_rows
from .window import ReadWindow
from .window import applies as window_applies

if TYPE_CHECKING:
    from . import CBInstall


TRASH_WAIT_S = 30.0  # how long a new cache (or a wake) waits for the memory of its two padding sectors
GROWTH_WAIT_S = 0.5  # how long a running request's growth waits for room coming before transformers may offload it


class NoRoom(RuntimeError):
    """kvcached could not give the sectors asked for (limit, shared budget or device)."""


class KvcachedCachePool(CachePool):
    """transformers' sector pool whose free sectors are kvcached's: sector ids are kvcached block ids."""

    def __init__(self, manager: KVCacheManager, num_sectors: int, num_allocators: int, device: torch.device) -> None:
        self.manager = manager
        self.sync = device.type == "cuda"  # a freed sector's page may be unmapped: no kernel may still touch it
        self.held: set[int] = set()  # sectors taken from kvcached and handed to an allocator
        self.after_free: Callable[[], None] | None = None  # the cache's: newly cached blocks go to kvcached
        self._free_seq, self._free_count = -1, 0
        self.in_pass = False  # a scheduling pass is under way: its room is asked at most once (see pass_free)
        self.pass_free: int | None = None  # within a pass, once asked: the sectors kvcached can still give
        super().__init__(num_sectors, num_allocators)

    def reset(self) -> None:
        """Every sector back to kvcached (the trash stays: the cache owns it)."""
        if getattr(self, "held", None):
            self.release(list(self.held))
        self.free_sectors: list[int] = []  # unused: kvcached is the free list
        self._free_blocks = [RegularTrees(bps) for bps in self.blocks_per_sector]

    @property
    def num_free_sectors(self) -> int:
        if self.in_pass:  # asked once per pass, at its first question (a pass that asks nothing costs nothing)
            if self.pass_free is None:
                self.pass_free = self.manager.schedulable_blocks()
            return self.pass_free
        manager = self.manager
        seq = manager.state_seq  # the answer only moves when the allocator publishes
        if seq != self._free_seq:
            self._free_count = manager.schedulable_blocks()
            self._free_seq = seq if not seq & 1 else -1
        return self._free_count

    def take(self, index: int, n: int) -> bool:
        """``n`` sectors for allocator ``index`` in one alloc; False (nothing taken) when kvcached says no."""
        ids = self.manager.alloc(n)
        if ids is None:
            return False
        self.taken(n)
        self.give(index, ids)
        return True

    def taken(self, n: int) -> None:
        """``n`` sectors just came from kvcached: the pass's count goes down."""
        if self.in_pass and self.pass_free is not None:
            self.pass_free = max(0, self.pass_free - n)

    def give(self, index: int, sectors: list[int]) -> None:
        """Sectors just taken from kvcached become allocator ``index``'s free blocks."""
        for sector in sectors:
            self._free_blocks[index].add_tree(sector)
        self.held.update(sectors)

    def allocate_sector(self, index: int) -> None:
        if not self.take(index, 1):
            raise NoRoom(f"{self.manager.name!r} has no room for one more sector")

    def free_blocks(self, index: int, block_ids: list[int]) -> None:
        super().free_blocks(index, block_ids)
        if block_ids:
            self.release(self._free_blocks[index].delete_full_trees())
        if self.after_free is not None:
            self.after_free()

    def try_to_free_sectors(self) -> None:
        for trees in self._free_blocks:
            self.release(trees.delete_full_trees())

    def release(self, sectors: list[int]) -> None:
        if not sectors:
            return
        if self.sync:
            torch.cuda.synchronize()
        self.held.difference_update(sectors)
        self.manager.free(sectors)
        if self.in_pass and self.pass_free is not None:
            self.pass_free += len(sectors)


class KvcachedPagedAttentionCache(PagedAttentionCache):
    """A :class:`PagedAttentionCache` whose tensor lies over kvcached pages (see the module docstring)."""

    def __init__(self, install: CBInstall, **kwargs: Any) -> None:
        device = torch.device(kwargs.pop("device"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        helper = kwargs["distributed_helper"]
        if getattr(helper, "tp_size", 1) > 1:
            raise ValueError("kvcached's continuous batching serves one process, not tensor parallelism")
        super().__init__(device="meta", **kwargs)  # upstream sizing and allocators, no memory
        self.device = device
        # The batch's read budget is the capacity (or the install's max_read_tokens); the attention buffers follow the
        # reads (see .window).
        self.read_budget = self.max_tokens_read
        self.read_cap = install.max_read_tokens
        self.window = ReadWindow(self.read_budget, self.tokens_per_sector_full) if window_applies(
            kwargs["continuous_batching_config"]) else None
        if self.window is not None:
            self.max_tokens_read = self.window.tokens  # what transformers sizes its attention buffers by
        self.install = install
        install.measure_working_memory(device)  # from before transformers allocates this cache's buffers
        total_sectors = self.num_sectors + 2
        self.kv_manager = manager = install.manager_for(self, total_sectors, device)
        rows = page_rows(manager, 0, 0, device)
        if not rows.is_contiguous():
            raise ValueError(f"the {manager.backend.name} backend's range is not one contiguous run of bytes")
        self.cache_tensor = rows.reshape(-1)[:total_sectors * self.bytes_per_sector]
        self.kv_pool = KvcachedCachePool(manager, self.num_sectors, len(self.cache_allocators), device)
        self.pool = self.kv_pool
        non_trash = self.num_sectors * self.bytes_per_sector
        for allocator in self.cache_allocators.values():
            allocator.register_cache_tensor(self.bytes_per_sector, non_trash, self.cache_tensor, self.pool)
        self.trash: list[int] = []
        self.take_trash()
        # Blocks transformers keeps for prefix sharing are kvcached's cached blocks when a block is a whole sector
        # (one attention type): kvtop shows them, and a limit or another model's reclaim evicts them.
        allocators = list(self.cache_allocators.values())
        self.mirrors = len(allocators) == 1 and allocators[0].blocks_per_sector == 1
        self._newly_cached: list[int] = []
        self._running: dict[str, Any] = {}  # the scheduler's active requests, during a pass
        self._reserve: int | None = None  # growth_reserve, once per pass
        self.refused: set[str] = set()  # the gates that held a waiting request back in this pass (stats.GATES)
        self.free_share = 1.0  # compute_free_capacity's last relative answer
        self._admitting = True  # see begin_pass
        self.deferred: set[str] = set()  # running requests whose growth waits for room coming, in this pass
        self._deferred_since: dict[str, float] = {}  # when each one's growth began to wait, passes in a row
        if self.mirrors:
            self._mirror(allocators[0].ledger)
            self.kv_pool.after_free = self.flush_cached

    # -- prefix-sharing blocks as kvcached's cached blocks ------------------------------------------------
    def _mirror(self, ledger: Any) -> None:
        release, acquire = ledger.release, ledger.acquire
        pending = self._newly_cached

        def mirrored_release(block_id: int, no_cache: bool = False) -> bool:
            back = release(block_id, no_cache)
            if not back and block_id in ledger.cached_blocks:
                pending.append(block_id)
            return bool(back)

        def mirrored_acquire(block_id: int) -> None:
            if block_id in ledger.cached_blocks:  # a prefix hit on a cached block: active again
                if block_id in pending:
                    pending.remove(block_id)
                else:
                    self.kv_manager.reuse([block_id])
            acquire(block_id)

        ledger.release, ledger.acquire = mirrored_release, mirrored_acquire

    def flush_cached(self) -> None:
        """Blocks transformers just kept for prefix sharing become kvcached's cached blocks (what its budget for
        cached blocks or idle packing evicts at once is forgotten here)."""
        if self._newly_cached:
            ids = [b for b in self._newly_cached if b in self.kv_pool.held]
            self._newly_cached.clear()
            if ids:
                self.forget(self.kv_manager.mark_cached(ids))

    def forget(self, blocks: list[int]) -> None:
        """kvcached evicted these cached blocks (and freed them): transformers forgets their content."""
        if not blocks:
            return
        ledger = next(iter(self.cache_allocators.values())).ledger
        for block in blocks:
            ledger.cached_blocks.pop(block, None)
            digest = ledger.block_to_hash.pop(block, None)
            if digest is not None and ledger.hash_to_block.get(digest) == block:
                del ledger.hash_to_block[digest]
        self.kv_pool.held.difference_update(blocks)

    def evict_for_kvcached(self) -> None:
        """A lowered limit or another model's reclaim waits on cached blocks: kvcached picks whole cached pages."""
        if self.mirrors:
            self.forget(self.kv_manager.evict_for_limit())
        elif self.evict_cached_blocks():  # several attention types: transformers' own eviction, all of them
            self.pool.try_to_free_sectors()

    def _take(self, n: int) -> list[int] | None:
        """``n`` sectors from kvcached; its cached blocks are evicted (and forgotten) to make room."""
        manager = self.kv_manager
        ids = manager.alloc(n)
        while ids is None and self.mirrors and manager.cached_blocks:
            evicted = manager.evict(max(1, n - manager.available_size(device=False)))
            if not evicted:
                break
            self.forget(evicted)
            ids = manager.alloc(n)
        return ids

    # -- one scheduling pass -------------------------------------------------------------------------
    def begin_pass(self, running: dict[str, Any], admitting: bool) -> None:
        """A scheduling pass starts: kvcached's room is asked at most once, when the pass first needs it (not at every
        waiting request; a pass of decodes that take no sector asks nothing), and counted down as the pass takes
        sectors; ``running`` is the scheduler's active requests (see :meth:`growth_reserve`); ``admitting``: a request
        waits or prefills, so transformers' safety margin decides something (see :meth:`compute_free_capacity`)."""
        pool = self.kv_pool
        pool.in_pass, pool.pass_free = True, None
        self._running, self._reserve, self._admitting = running, None, admitting
        self.refused = set()
        self.deferred = set()

    def end_pass(self) -> None:
        pool = self.kv_pool
        pool.in_pass, pool.pass_free = False, None
        self._running, self._reserve, self._admitting = {}, None, True
        now = time.monotonic()  # a request whose growth was not deferred in this pass starts afresh
        self._deferred_since = {rid: self._deferred_since.get(rid, now) for rid in self.deferred}

    def defer_growth(self, request_id: str, *, counted: bool) -> bool:
        """A running request's growth missed though room is coming: the room counted for the pass had it (free
        budget, or other models' warm pools, which the miss just asked for), or this model's refill is mapping pages.
        Whether it waits for it, kept out of transformers' starved requests (which it would offload: a preemption)
        and woken by the room handler. It waits at most :data:`GROWTH_WAIT_S` in a row; then it starves, as in a
        static cache; with no room coming it starves at once."""
        if not (counted or self.kv_manager.pages.inflight):
            return False
        since = self._deferred_since.get(request_id)
        if since is not None and time.monotonic() - since > GROWTH_WAIT_S:
            return False
        self.deferred.add(request_id)
        return True

    def growth_reserve(self) -> int:
        """Sectors kept back for running requests when a new one is admitted: one for each allocator's blocks that
        the running requests' next two tokens do not fit (less the free blocks it holds). A request whose last block
        has room, or that ends within two tokens, needs none."""
        if self._reserve is not None:
            return self._reserve
        reserve = 0
        for allocator in self.cache_allocators.values():
            blocks = 0
            for rid, state in self._running.items():
                left = None if state.max_new_tokens is None else state.max_new_tokens - len(state.generated_tokens)
                if rid in allocator.block_table and (left is None or left >= 2):
                    blocks += min(1, allocator.needs_new_blocks(rid, state.current_len(), 2))
            short = blocks - self.pool.count_free_blocks(allocator.index)
            if short > 0:
                reserve += -(-short // allocator.blocks_per_sector)
        self._reserve = reserve
        return reserve

    def pass_read_budget(self, scheduler: Any) -> int:
        """The cached tokens the next batch may read: the capacity, or ``max_read_tokens`` where the install sets it
        but at least the longest read of one waiting or running request (each can always run, if alone)."""
        if self.read_cap is None:
            return self.read_budget
        states = [*scheduler.active_requests.values(), *scheduler.waiting_requests.values()]
        longest = max((state.current_len() for state in states), default=0)
        return min(self.read_budget, max(self.read_cap, longest))

    @staticmethod
    def page_size_for(bytes_per_sector: int) -> int:
        """kvcached's page: the configured one if it holds whole sectors, else the least multiple of both."""
        page = settings().page_size_bytes
        return page if page % bytes_per_sector == 0 else lcm(page, bytes_per_sector)

    @property
    def tokens_per_sector_full(self) -> int:
        """Tokens one sector holds for one request (its largest allocator's share): the segment's block_tokens."""
        return max(ca.tokens_per_page * ca.blocks_per_sector for ca in self.cache_allocators.values())

    # -- trash ---------------------------------------------------------------------------------
    def take_trash(self) -> None:
        """Two sectors for padding: the first zeroed (read), the second written; the allocators point at them."""
        if self.trash:
            return
        deadline = time.monotonic() + TRASH_WAIT_S
        while (ids := self.kv_manager.alloc(2)) is None:  # a refused alloc asks the other models of the budget
            if time.monotonic() > deadline:
                raise NoRoom(f"{self.kv_manager.name!r} found no room for its two padding sectors in "
                             f"{TRASH_WAIT_S:g} s (its limit, or a budget the other models hold)")
            time.sleep(0.01)
        read, write = ids
        size = self.bytes_per_sector
        self.cache_tensor[read * size:(read + 1) * size].zero_()
        for allocator in self.cache_allocators.values():
            stride = allocator.block_physical_stride * allocator.blocks_per_sector  # rows per sector
            allocator.read_trash_index = read * stride
            allocator.sentinel_index = read * stride + 1
            allocator.write_trash_index = write * stride
        self.trash = ids

    def release_trash(self) -> None:
        if self.trash:
            self.kv_pool.release(self.trash)
            self.trash = []

    # -- what the scheduler calls ------------------------------------------------------------------
    def can_store_request_tokens(self, state: Any, request_len: int, dry_run: bool = False) -> bool:
        """As upstream, with the sectors taken from kvcached in one alloc: all or none."""
        needed = {name: allocator.needs_new_sectors(state.request_id, state.current_len(), request_len)
                  for name, allocator in self.cache_allocators.items()}
        total = sum(n for n in needed.values() if n > 0)
        if dry_run:
            return self.pool.num_free_sectors >= total
        pool = self.pool
        assert isinstance(pool, KvcachedCachePool)
        if total:
            running = state.status.name != "PENDING"
            free = pool.num_free_sectors
            if free < total and not running:
                self.refused.add("budget")
            elif not running and free - self.growth_reserve() < total:
                # A new request is admitted beside the growth the running ones still need: it must not starve them.
                self.refused.add("reserve")
                free -= self.growth_reserve()
            # A running request's growth always tries: the count may be behind the budget, and a miss asks the other
            # models for the room (a reclaim), which the request then waits for instead of being offloaded.
            ids = self._take(total) if free >= total or running else None
            if ids is None:
                # (the room counted was not there: the refused alloc asks the other models for it)
                self.refused.add("budget")
                if running:
                    self.defer_growth(state.request_id, counted=free >= total)
                return False
            pool.taken(total)
            at = 0
            for name, n in needed.items():
                if n > 0:
                    pool.give(self.cache_allocators[name].index, ids[at:at + n])
                    at += n
        for allocator in self.cache_allocators.values():
            allocator.allocate_cache_to_request(state.request_id, state.current_len(), request_len)
        return True

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """Free bytes; ``relative``: their share of what the model holds plus what it may take (transformers' FIFO
        safety margin is taken over this, as a static cache's over its whole size), not of its address space."""
        if relative and self.kv_pool.in_pass and not self._admitting:
            return 1.0  # nothing waits or prefills: the margin decides nothing, and the room is not asked for it
        free_sectors = self.pool.num_free_sectors
        free = free_sectors * self.bytes_per_sector
        for allocator in self.cache_allocators.values():
            free += self.pool.count_free_blocks(allocator.index) * allocator.bytes_per_block
        if not relative:
            return free
        reach = (len(self.kv_pool.held) + free_sectors) * self.bytes_per_sector
        self.free_share = free / reach if reach else 0.0
        return self.free_share

    def release_all(self) -> None:
        """Forget every request and cached block; every sector, the trash included, back to kvcached."""
        self.free_all_requests(clear_ledgers=True)
        self.pool.reset()
        self.release_trash()
