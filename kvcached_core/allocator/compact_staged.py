"""Two-phase compaction, for an engine whose copy runs with a later step of its own (vLLM's block copies).

The synchronous contract (:data:`kvcached_core.allocator.compact.CompactHandler`) needs the copy done
before the handler returns. An engine that can only have its worker copy blocks at its next step
registers a poke instead (:meth:`KVCacheManager.set_compact_poke`) and compacts on its own thread:

- :meth:`~KVCacheManager.compact_begin` plans moves of cached blocks (at most ``max_moves``, whole
  source pages first), takes the destinations and holds the sources and the source pages' free slots:
  none is evicted, freed or handed out until the ticket ends, so no page under a pending copy is unmapped
  and no block allocated meanwhile lands on a page the round empties. The engine re-points
  its prefix index to the destinations and queues the copies into its next step;
- :meth:`~KVCacheManager.compact_commit`, once that step came back, frees the sources, unmaps the pages
  emptied and caches the destinations (a destination a prefix hit took meanwhile, through ``reuse``,
  stays with its request). When no move is left, a controller waiting (``kvctl compact``) is answered
  with the compaction's totals and an idle packing deferred for it runs (its evicted blocks come back);
- :meth:`~KVCacheManager.compact_abort` undoes a begin whose copies were never sent.

Whenever a compaction is wanted (a controller asked, or idle packing would have evicted cached
blocks that compaction can keep) the allocator calls the poke, from any thread with its lock held;
the engine then steps (an idle one runs an empty step) until :attr:`KVCacheManager.compact_wanted`
is False.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..segment import layout as L
from .compact import CompactResult, Move, plan

if TYPE_CHECKING:
    from .parts import Allocator

CompactPoke = Callable[[], None]  # asks the engine's thread to compact (begin, its step, commit); must not block


@dataclass
class CompactTicket:
    """One begun round: the moves whose copies the engine carries in one step."""

    moves: tuple[Move, ...]
    started_ns: int
    reused: set[int] = field(default_factory=set)  # destinations a prefix hit took before the commit
    # the free slots of the source pages, held until the round ends: a block the engine allocates meanwhile (a
    # busy engine's next step) never lands on a page the round is emptying
    held: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompactStep:
    """What a commit did: the round's figures, the cached blocks idle packing evicted once the compaction
    finished (drop them from the prefix index), and whether the compaction is finished."""

    result: CompactResult
    evicted: list[int]
    done: bool


def cap_moves(moves: list[Move], max_moves: int | None, blocks_per_page: int) -> list[Move]:
    """The first moves of ``moves`` (grouped by source page, as :func:`plan` orders them) up to ``max_moves``:
    whole source pages while they fit, else part of the first one (a later round moves the rest)."""
    if max_moves is None or len(moves) <= max_moves:
        return moves
    if max_moves < 1:
        raise ValueError(f"max_moves must be at least 1, not {max_moves}")
    end = 0
    while end < len(moves):
        page = moves[end][0] // blocks_per_page
        stop = end
        while stop < len(moves) and moves[stop][0] // blocks_per_page == page:
            stop += 1
        if stop > max_moves:
            break
        end = stop
    return moves[:end] if end else moves[:max_moves]


class StagedCompaction:
    """The allocator's side of two-phase compaction; every method runs with the manager's lock held."""

    def __init__(self, manager: Allocator) -> None:
        self.m = manager
        self.poke: CompactPoke | None = None
        self.ticket: CompactTicket | None = None
        self.seq = 0  # the newest controller request waiting for this compaction's end (0: none)
        self.idle = False  # idle packing waits for the compaction to end, then evicts what is still over
        self.copied = self.returned = 0  # the running compaction's totals, for the controller's answer

    @property
    def wanted(self) -> bool:
        live = self.poke is not None and not self.m._closed  # a closed allocator compacts nothing
        return live and (self.ticket is not None or self.seq > 0 or self.idle)

    def request(self, seq: int) -> None:
        """A controller asked (``kvctl compact``): answered when no move is left."""
        if seq > self.seq:
            self.seq = seq
            self._poke()

    def defer_pack(self) -> bool:
        """Idle packing is due: when compaction can keep cached blocks it would evict, ask the engine to
        compact first and pack once it is done (True); False: pack now."""
        m = self.m
        if self.poke is None or m.policy.pack_ratio is None or not m.cache.blocks:
            return False
        if not self.wanted and not plan(m.pages, m.cache):
            return False
        if not self.idle:
            self.idle = True
            self._poke()
        return True

    def _poke(self) -> None:
        if self.poke is not None:
            self.poke()

    def begin(self, max_moves: int | None) -> CompactTicket:
        if self.ticket is not None:
            raise RuntimeError(f"{self.m.name}: a compaction is in flight; commit or abort it first")
        m = self.m
        bpp = m.blocks_per_page
        moves = cap_moves(plan(m.pages, m.cache), max_moves, bpp)
        for src, dst in moves:
            m.pages.take_block(dst)
            m.cache.remove(src)
            m._dirty.update((src // bpp, dst // bpp))  # the allocator's own bookkeeping
        held: list[int] = []
        for page in sorted({src // bpp for src, _ in moves}):
            free = m.pages.cap[page] - m.pages.used[page]
            if free:
                held += m.pages.take_blocks(page, free)
        ticket = CompactTicket(tuple(moves), time.monotonic_ns(), held=tuple(held))
        self.ticket = ticket
        if moves:
            m._publish()
        return ticket

    def _own(self, ticket: CompactTicket) -> None:
        if ticket is not self.ticket:
            raise ValueError(f"{self.m.name}: not the compaction in flight (committed or aborted already?)")
        self.ticket = None

    def _pending_destination(self, block: int) -> bool:
        """A destination of ``self.ticket`` still taken by it (not reused, freed or cached meanwhile)."""
        return self.m.pages.is_used(block) and block not in self.m.cache

    def commit(self, ticket: CompactTicket) -> CompactStep:
        self._own(ticket)
        m = self.m
        moves = ticket.moves
        for _, dst in moves:
            if dst not in ticket.reused and self._pending_destination(dst):
                m.cache.add(dst)
                m._dirty.add(dst // m.blocks_per_page)  # a publish since begin wrote it as used, not cached
        mapped_before = m.pages.mapped_pages
        m._release_blocks([src for src, _ in moves] + list(ticket.held))
        emptied = {src // m.blocks_per_page for src, _ in moves}
        pool = [p for p in m.pages.reserved if p in emptied]
        if pool:  # an emptied page is unmapped, not kept in the warm pool
            m.pages.reserved[:] = [p for p in m.pages.reserved if p not in emptied]
            m.backend.unmap_pages(pool)
            m.pages.mark_unmapped(pool)
            m._dirty.update(pool)
        returned = (mapped_before - m.pages.mapped_pages) * m.bundle_bytes
        copied = len(moves) * m.block_bytes * m.num_layers * m.num_kv_buffers * m.tp_world
        result = CompactResult(moves, len(moves), copied, returned)
        if moves:
            m.compaction.count(result, time.monotonic_ns() - ticket.started_ns)
        self.copied += copied
        self.returned += returned
        done = not plan(m.pages, m.cache)
        evicted = self._finish(L.COMPACT_DONE) if done else []
        m._publish()
        m.segment.publish_compaction(m.compaction.values())
        return CompactStep(result, evicted, done)

    def abort(self, ticket: CompactTicket) -> list[int]:
        if ticket.reused:
            raise ValueError(f"{self.m.name}: a prefix hit took destinations {sorted(ticket.reused)[:8]}; "
                             f"the copies must run and the round be committed")
        self._own(ticket)
        m = self.m
        for src, _ in ticket.moves:
            m.cache.add(src)
            m._dirty.add(src // m.blocks_per_page)
        m._release_blocks([dst for _, dst in ticket.moves if self._pending_destination(dst)] + list(ticket.held))
        evicted = self._finish(L.COMPACT_FAILED)
        m._publish()
        m.segment.publish_compaction(m.compaction.values())
        return evicted

    def _finish(self, status: int) -> list[int]:
        """The compaction ended: answer the controllers waiting, then run the idle packing deferred for it."""
        m = self.m
        if self.seq:
            m.compaction.answer(self.seq, status, self.copied, self.returned)
            self.seq = 0
        self.copied = self.returned = 0
        if not self.idle:
            return []
        self.idle = False
        return m._pack(compact=False)

    def claim(self, blocks: list[int]) -> set[int]:
        """Of ``blocks`` (not cached), the in-flight destinations: a prefix hit may take them (``reuse``)."""
        ticket = self.ticket
        if ticket is None:
            return set()
        pending = {dst for _, dst in ticket.moves} - ticket.reused
        return {b for b in blocks if b in pending and self._pending_destination(b)}
