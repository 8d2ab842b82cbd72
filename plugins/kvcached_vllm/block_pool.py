"""The scheduler side: vLLM's block pool with kvcached deciding which block ids are free.

vLLM keeps its own bookkeeping of blocks (``KVCacheBlock`` objects, reference counts, the
prefix-cache hash map); what changes is where a free block comes from and where it goes:

- a new block comes from :meth:`KVCacheManager.alloc` (never from vLLM's free queue, which is
  left empty here);
- a block whose last reference goes becomes free (no hash) or cached (it has a prefix hash):
  ``free`` or ``mark_cached``, so cached blocks show in the page map and the prefix-cache budget
  (``KVCACHED_MAX_CACHED_TOKENS``) holds;
- a prefix hit on a cached block is ``reuse``; whenever kvcached evicts cached blocks (budget,
  idle packing, room for new blocks, a lowered limit: :meth:`KvcachedBlockPool.evict_for_limit`) their
  hashes leave vLLM's map before anything else runs.

The free count vLLM schedules against is ``KVCacheManager.schedulable_blocks``: what kvcached
can hand out under its limit plus the cached blocks it could evict (under a deferred limit, only
the limit's room, so the scheduler preempts and queues until the model fits). When that is not enough after all (a limit lowered by a
controller, a full device), :class:`NoRoom` is raised and the wrapped ``allocate_slots`` turns it
into vLLM's own "cannot allocate" answer, so the scheduler queues or preempts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached_core import KVCacheManager

from .compact import Compactor

log = logging.getLogger(__name__)
START_WAIT_S = 30.0  # how long a starting engine waits for its first block under a full shared budget


class NoRoom(RuntimeError):
    """kvcached could not hand out the blocks vLLM's free count promised (the limit fell, the device is full)."""


class KvcachedBlockPool(BlockPool):
    """A :class:`BlockPool` whose free blocks live in a :class:`KVCacheManager`."""

    def __init__(self, manager: KVCacheManager, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 **kwargs: object) -> None:
        if num_gpu_blocks != manager.num_blocks:
            raise ValueError(f"vLLM asks for {num_gpu_blocks} blocks, the allocator holds {manager.num_blocks}")
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, **kwargs)
        self.manager = manager
        # vLLM popped block 0 as its placeholder; take the placeholder from the allocator instead, so
        # the page it sits on is mapped (vLLM may point block tables at it) and shows as in use.
        ids = manager.alloc(1)
        deadline = time.monotonic() + START_WAIT_S
        while ids is None and time.monotonic() < deadline:
            # A shared budget another model's pages fill (an idle engine's prefix cache, kept packed by compaction):
            # the missed alloc asked the others for a page; their pollers give it back within a tick or two.
            time.sleep(0.05)
            ids = manager.alloc(1)
        if ids is None:
            raise NoRoom(f"no room for a single block in {manager.name!r} (limit or device full)")
        self.null_block.is_null = False
        self.null_block: KVCacheBlock = self.blocks[ids[0]]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue([])  # the allocator is the one free list
        self.placeholders = 1  # blocks the allocator holds for the placeholder: 0 while the model sleeps
        self._free_seq, self._free_count = -1, 0  # get_num_free_blocks' answer and the state it was for
        # Set by the scheduler's wrappers: while it admits a waiting request, blocks of a shared budget kept back
        # for the running requests' growth (one each: the next block any of them may need).
        self.growth_reserve = 0
        self.admitting = False
        self.compactor = Compactor(self)  # compaction through the scheduler's block copies (attached by the busy loop)

    # -- what vLLM schedules against -----------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        # vLLM asks for every request of every step; the answer only moves when the allocator publishes.
        if self.admitting and self.growth_reserve:
            return self.manager.schedulable_blocks(self.growth_reserve)
        seq = self.manager.state_seq  # read before the count: a publish in between only forces a recount
        if seq != self._free_seq:
            self._free_count = self.manager.schedulable_blocks()
            self._free_seq = seq if not seq & 1 else -1
        return self._free_count

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        ids = self._take(num_blocks)
        blocks = [self.blocks[i] for i in ids]
        collector = self.metrics_collector
        for block in blocks:
            if block.block_hash is not None:  # cannot happen: evicted blocks lose their hash at once
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, f"block {block.block_id} handed out while referenced"
            block.ref_cnt = 1
            if collector:
                collector.on_block_allocated(block)
        return blocks

    def _take(self, n: int) -> list[int]:
        manager = self.manager
        ids = manager.alloc(n)
        while ids is None and manager.cached_blocks:
            evicted = manager.evict(max(1, n - manager.available_size(device=False)))
            if not evicted:
                break
            self._forget(evicted)
            ids = manager.alloc(n)
        if ids is None:
            raise NoRoom(f"{manager.name!r} has no room for {n} blocks")
        return ids

    # -- references ----------------------------------------------------------------------------
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        revived = []
        collector = self.metrics_collector
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                revived.append(block.block_id)
            block.ref_cnt += 1
            if collector:
                collector.on_block_accessed(block)
        if revived:
            self.manager.reuse(revived)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        to_free: list[int] = []
        to_cache: list[int] = []
        others: dict[BlockPool, list[KVCacheBlock]] = {}
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.pool is not None and block.pool is not self:
                others.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if caching and block.block_hash is not None:
                    to_cache.append(block.block_id)
                else:
                    to_free.append(block.block_id)
        if to_free:
            self.manager.free(to_free)
        manager = self.manager
        if to_cache:
            self._forget(manager.mark_cached(to_cache))
        if to_free or to_cache:
            self.pack_if_idle()
        for pool, blocks in others.items():
            pool.free_blocks(blocks)

    def pack_if_idle(self) -> None:
        """Only the placeholder is active: the engine went idle. kvcached packs an idle model by itself when
        nothing is active, which the placeholder hides from it: ask here (with a compactor attached, it
        compacts first over the next steps, see :mod:`.compact`)."""
        manager = self.manager
        if manager.used_blocks - manager.cached_blocks == self.placeholders:
            self._forget(manager.pack())

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: object) -> None:
        raise NotImplementedError("kvcached does not serve HiSparse pools: run without ENABLE_KVCACHED")

    # -- prefix cache ----------------------------------------------------------------------------
    def _forget(self, block_ids: Iterable[int]) -> None:
        """kvcached evicted these cached blocks: drop their hashes so no request can hit them."""
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def evict_for_limit(self) -> None:
        """A lowered limit waits on cached blocks: evict them (kvcached picks whole cached pages, only as many as the
        limit needs) and drop their hashes. On the engine's thread between steps only, never inside
        ``allocate_slots``: there a prefix hit found before the free count is taken only afterwards."""
        evicted = self.manager.evict_for_limit()
        if evicted:
            self._forget(evicted)

    def evict_blocks(self, block_ids: set[int]) -> None:
        freed = []
        for block_id in block_ids:
            if not 0 <= block_id < len(self.blocks):
                raise ValueError(f"invalid block id {block_id} (the pool holds {len(self.blocks)})")
            block = self.blocks[block_id]
            if self._maybe_evict_cached_block(block) and block.ref_cnt == 0 and not block.is_null:
                freed.append(block_id)
        if freed:
            self.manager.free(freed)

    def reset_prefix_cache(self) -> bool:
        manager = self.manager
        active = manager.used_blocks - manager.cached_blocks - self.placeholders
        if active:
            log.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet", active)
            return False
        self._forget(manager.evict(manager.cached_blocks))
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        log.info("Successfully reset prefix cache")
        return True

    # -- sleep (see .sleep) ---------------------------------------------------------------------
    def release_placeholder(self) -> None:
        """The model goes to sleep and nothing runs: its placeholder block goes back too, so no page stays."""
        if self.placeholders:
            self.manager.free([self.null_block.block_id])
            self.placeholders = 0

    def take_placeholder(self) -> None:
        """Wake: a block for the placeholder again. Any free block will do (its contents are never read
        as KV); the placeholder object keeps its identity (vLLM's managers hold it) and takes the new id."""
        if self.placeholders:
            return
        ids = self.manager.alloc(1)
        if ids is None:
            raise NoRoom(f"no room for a single block in {self.manager.name!r} (limit or device full)")
        null, new = self.null_block, ids[0]
        old = null.block_id
        if new != old:  # two free blocks swap ids: the placeholder object now stands for block `new`
            other = self.blocks[new]
            assert other.ref_cnt == 0 and other.block_hash is None, f"block {new} handed out while in use"
            self.blocks[new], self.blocks[old] = null, other
            null.block_id, other.block_id = new, old
        self.placeholders = 1

    def close(self) -> None:
        self.manager.close()
