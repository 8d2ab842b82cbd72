"""Compaction on vLLM through the scheduler's block copies (the allocator's two-phase compaction).

vLLM's scheduler hands its worker a list of block copies with every step
(``SchedulerOutput.kv_cache_block_copies``, taken from ``KVCacheManager.take_kv_cache_block_copies``
at the end of ``Scheduler.schedule``); the worker runs them before that step's forward pass, zero-token
steps included. A round of compaction rides on one step, all on the engine's thread:

- in ``take_kv_cache_block_copies`` (after the step's prefix lookups and allocations), the allocator plans
  at most :data:`MAX_MOVES_PER_STEP` moves of cached blocks (ref count 0, hashed: never the placeholder,
  blocks waiting to be freed or blocks a request holds), takes the destinations and holds the sources;
  ``BlockPool.move_block_hashes`` re-points each source's hashes to its destination and the copies join
  the step's list. A request that hits a destination does so in a later step, whose forward pass runs
  after these copies on the worker;
- in ``update_from_output`` of the step that carried them, the round is committed: the allocator frees the
  sources and unmaps the pages emptied.

An idle engine steps only while its scheduler has requests, so ``Scheduler.has_requests`` also answers
True while a compaction is wanted: the busy loop runs empty (zero-token) steps that carry the copies.
The allocator asks for a compaction (``kvctl compact``, idle packing) through a ``WAKEUP`` on the
EngineCore's input queue, as for sleep and limits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy

from kvcached_core.engines import CompactStep, CompactTicket, KVCacheManager


class Pool(Protocol):
    """What compaction uses of the block pool (block_pool.KvcachedBlockPool, which holds a Compactor)."""

    manager: KVCacheManager
    blocks: list[KVCacheBlock]

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None: ...
    def _forget(self, block_ids: Iterable[int]) -> None: ...
    def pack_if_idle(self) -> None: ...

log = logging.getLogger("kvcached_vllm")

MAX_MOVES_PER_STEP = 64  # blocks copied with one step at most (a step's copy stays small next to its forward pass)


class Compactor:
    """One engine's compaction rounds (its scheduler's thread only)."""

    def __init__(self, pool: Pool, max_moves: int = MAX_MOVES_PER_STEP) -> None:
        self.pool = pool
        self.max_moves = max_moves
        self.attached = False
        self.ticket: CompactTicket | None = None
        self.copies: list[KVCacheBlockCopy] = []  # the round's copies, until a step's output is seen carrying them
        self.output: Any = None  # the SchedulerOutput carrying the round in flight
        self.rounds: list[tuple[int, int]] = []  # (moves, ns from begin to commit) of the last rounds, newest last

    def attach(self, poke: Callable[[], None]) -> None:
        """The busy loop runs: the allocator may ask for compactions from now on (``poke`` wakes the loop)."""
        self.pool.manager.set_compact_poke(poke)
        self.attached = True

    @property
    def wanted(self) -> bool:
        """A round is in flight or the allocator wants one: the engine must step."""
        return self.ticket is not None or (self.attached and self.pool.manager.compact_wanted)

    def begin(self) -> list[KVCacheBlockCopy]:
        """Start a round if one is wanted; the copies for the step being scheduled."""
        if self.ticket is not None or not self.attached:
            return []
        manager, pool = self.pool.manager, self.pool
        if not manager.compact_wanted:
            return []
        with manager.lock:
            ticket = manager.compact_begin(self.max_moves)
            if not ticket.moves:  # nothing left to move: the compaction ends here
                self._ended(manager.compact_commit(ticket))
                return []
            moved: list[tuple[int, int]] = []
            try:
                for src, dst in ticket.moves:
                    source, destination = pool.blocks[src], pool.blocks[dst]
                    if (source.ref_cnt or source.is_null or source.block_hash is None
                            or destination.ref_cnt or destination.block_hash is not None):
                        raise RuntimeError(f"block {src} -> {dst} is not a cached block into a free one")
                    pool.move_block_hashes(source, destination)
                    moved.append((src, dst))
            except Exception:
                log.exception("kvcached: compaction of %r stopped; nothing moved", manager.name)
                for src, dst in reversed(moved):
                    pool.move_block_hashes(pool.blocks[dst], pool.blocks[src])
                pool._forget(manager.compact_abort(ticket))
                return []
        self.ticket, self.output = ticket, None
        self.copies = [KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in ticket.moves]
        return list(self.copies)

    def scheduled(self, output: Any) -> None:
        """``schedule`` returned: remember the output that carries the round's copies."""
        if self.ticket is not None and self.output is None:
            carried = output.kv_cache_block_copies or ()
            if self.copies and self.copies[0] in carried:
                self.output = output

    def unscheduled(self) -> None:
        """``schedule`` failed after the round began: no step carries its copies, so undo it."""
        ticket = self.ticket
        if ticket is None or self.output is not None:
            return
        pool = self.pool
        for src, dst in reversed(ticket.moves):
            pool.move_block_hashes(pool.blocks[dst], pool.blocks[src])
        self.ticket, self.copies = None, []
        pool._forget(pool.manager.compact_abort(ticket))

    def stepped(self, scheduler_output: Any) -> None:
        """``update_from_output`` of a step: the step carrying the round came back, so its copies ran: commit."""
        ticket = self.ticket
        if ticket is None or scheduler_output is not self.output:
            return
        self.ticket, self.output, self.copies = None, None, []
        step = self.pool.manager.compact_commit(ticket)
        self.rounds = [*self.rounds[-255:], (len(ticket.moves), time.monotonic_ns() - ticket.started_ns)]
        self._ended(step)

    def _ended(self, step: CompactStep) -> None:
        self.pool._forget(step.evicted)
        if step.done:
            self.pool.pack_if_idle()
