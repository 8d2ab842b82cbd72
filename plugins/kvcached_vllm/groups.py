"""vLLM's KV cache groups, counted for the model's segment: kvtop and kvctl show each group's blocks and pages.

vLLM gives the layers that share a block table a group (a model with sliding-window layers beside full ones has
two, over one pool of block ids). Counted in the EngineCore from vLLM's own bookkeeping: each group's manager
lists the blocks of every request (``req_to_blocks``: the active ones), and a cached block's prefix hash carries
its group (``KVCacheBlock.block_hash``; kvcached knows which blocks are cached). A count looks at every block in
use, so it runs at most every ``PERIOD_S`` while requests run, and after every step and client request of an idle
engine (``KVCacheManager.publish_groups``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvcached_core.engines import MAX_GROUPS

from .geometry import KVGroup

log = logging.getLogger(__name__)
PERIOD_S = 0.5


class Groups:
    """The groups of one scheduler and their last published counts."""

    def __init__(self, scheduler: Any, pool: Any, groups: tuple[KVGroup, ...]) -> None:
        self.scheduler, self.pool, self.groups = scheduler, pool, groups
        self._next = 0.0
        self.enabled = 0 < len(groups) <= MAX_GROUPS
        if not self.enabled:
            log.info("kvcached: %d KV cache groups, more than a segment holds (%d): none published",
                     len(groups), MAX_GROUPS)
        self.publish(idle=True)

    def publish(self, *, idle: bool) -> None:
        """Count and publish: while requests run at most every ``PERIOD_S``, every time when none does (``idle``:
        the steps and requests of an idle engine are few, and what kvtop shows of it must be its last state)."""
        now = time.monotonic()
        if not self.enabled or (not idle and now < self._next):
            return
        self._next = now + PERIOD_S
        self.pool.manager.publish_groups(self.count())

    def count(self) -> list[tuple[str, int | None, int, int, int, int]]:
        from vllm.v1.core.kv_cache_utils import get_group_id

        pool = self.pool
        bpp = pool.manager.blocks_per_page
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        active: list[set[int]] = [{b.block_id for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null}
                                  for m in managers]
        cached: list[set[int]] = [set() for _ in managers]
        for block_id in pool.manager.cached_block_ids():
            key = pool.blocks[block_id].block_hash
            if key is not None and (group := get_group_id(key)) < len(cached):
                cached[group].add(block_id)
        return [(g.shape, g.window, len(g.layer_names), len(active[i]), len(cached[i]),
                 len({b // bpp for b in active[i] | cached[i]}))
                for i, g in enumerate(self.groups)]
