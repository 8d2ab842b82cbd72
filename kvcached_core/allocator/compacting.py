"""Compaction run through the engine's copy: at once (``compact``, a compact handler) or in two phases.

:class:`Compacting` is one face of :class:`~kvcached_core.allocator.manager.KVCacheManager` (a base class of it):
its methods are the manager's own; it never imports the manager. The plan is :mod:`.compact`'s, the two-phase
steps :mod:`.compact_staged`'s.
"""

from __future__ import annotations

import logging
import time
from numbers import Integral
from typing import Protocol

from .compact import CompactHandler, CompactResult, Move, plan
from .compact_staged import CompactPoke, CompactStep, CompactTicket
from .served import Served


class _Compacts(Served, Protocol):
    """What compaction reaches of the allocator."""

    def _holds_destination(self, block: int) -> bool: ...
    def _confirmed(self, moves: list[Move], answer: object) -> list[Move]: ...


class Compacting:
    """The manager's compaction methods (see the module docstring)."""

    def set_compact_handler(self: _Compacts, handler: CompactHandler | None) -> None:
        """The engine's copy for :meth:`compact` (see :mod:`kvcached_core.allocator.compact`); None removes it.

        The handler is called with the manager's lock held, from the thread that asked: the engine's
        own (``compact()``, idle packing in ``mark_cached``) or the process's poller (``kvctl compact``);
        an engine whose own thread reads its prefix index meanwhile guards that index itself.
        """
        with self._lock:
            self._check_open()
            self._compact_handler = handler
            if handler is not None:
                self.staged.poke = None
            self.compaction.capable = handler is not None or self.staged.poke is not None
            self.segment.publish_compaction(self.compaction.values())

    def set_compact_poke(self: _Compacts, poke: CompactPoke | None) -> None:
        """Two-phase compaction (:mod:`kvcached_core.allocator.compact_staged`), instead of a compact handler: the
        engine's thread compacts with :meth:`compact_begin` / :meth:`compact_commit`; ``poke`` (called with the
        lock held, from any thread; it must not block) asks it to, for ``kvctl compact`` and idle packing.
        None removes it."""
        with self._lock:
            self._check_open()
            self.staged.poke = poke
            if poke is not None:
                self._compact_handler = None
            self.compaction.capable = poke is not None or self._compact_handler is not None
            self.segment.publish_compaction(self.compaction.values())

    @property
    def compact_wanted(self: _Compacts) -> bool:
        """A two-phase compaction is asked for or under way: the engine should step (begin, carry, commit)."""
        return self.staged.wanted

    def compact_begin(self: _Compacts, max_moves: int | None = None) -> CompactTicket:
        """Plan up to ``max_moves`` moves of cached blocks, take their destinations and hold their sources (none
        is evicted, freed or handed out until the ticket ends). The engine re-points its prefix index to the
        destinations, has the copies run with its next step, then calls :meth:`compact_commit` (an empty
        ticket: at once). RuntimeError while another ticket is open."""
        with self._lock:
            self._check_open()
            return self.staged.begin(max_moves)

    def compact_commit(self: _Compacts, ticket: CompactTicket) -> CompactStep:
        """The step that carried ``ticket``'s copies came back: free the sources, unmap the pages emptied, cache the
        destinations. When no move is left, a waiting ``kvctl compact`` is answered and a deferred idle packing
        runs: drop ``evicted`` from the prefix index."""
        with self._lock:
            self._check_open()
            return self.staged.commit(ticket)

    def compact_abort(self: _Compacts, ticket: CompactTicket) -> list[int]:
        """Undo a begin whose copies were never sent: sources cached again, destinations freed; a waiting controller
        is told it failed. Returns the blocks a deferred idle packing evicted instead. ValueError once a prefix
        hit took a destination (the copies must run)."""
        with self._lock:
            self._check_open()
            return self.staged.abort(ticket)

    def compact(self: _Compacts) -> CompactResult:
        """Move cached blocks out of sparse pages into holes of dense ones and unmap the pages emptied.

        The engine's handler gets the remap list, copies the KV data and returns the moves it
        completed; it must also rewrite its own block ids. Only confirmed sources are freed; a
        destination it did not confirm is released again. A handler that raises changes nothing.
        """
        with self._lock:
            self._check_open()
            if self._compact_handler is None:
                raise RuntimeError("no compaction handler: the engine must call set_compact_handler first")
            return self._compact()

    def _compact(self: _Compacts) -> CompactResult:
        """compact(), lock held and a handler registered; counts what moved in the COMPACT words."""
        handler = self._compact_handler
        assert handler is not None
        started = time.monotonic_ns()
        moves = plan(self.pages, self.cache)
        if not moves:
            return CompactResult((), 0, 0, 0)
        for _, dst in moves:
            self.pages.take_block(dst)
        try:
            confirmed = self._confirmed(moves, handler(list(moves)))
        except BaseException:  # the handler failed or answered wrong: nothing moves
            self._release_blocks([dst for _, dst in moves if self._holds_destination(dst)])
            self._publish()
            raise
        ok = {s for s, _ in confirmed}
        self._release_blocks([d for s, d in moves if s not in ok and self._holds_destination(d)])
        for src, dst in confirmed:
            self.cache.remove(src)
            self.cache.add(dst)
            self._dirty.update((src // self.blocks_per_page, dst // self.blocks_per_page))
        mapped_before = self.pages.mapped_pages
        self._release_blocks([s for s, _ in confirmed])
        emptied = {s // self.blocks_per_page for s, _ in confirmed}
        pool = [p for p in self.pages.reserved if p in emptied]
        if pool:
            self.pages.reserved[:] = [p for p in self.pages.reserved if p not in emptied]
            self.backend.unmap_pages(pool)
            self.pages.mark_unmapped(pool)
            self._dirty.update(pool)
        returned = (mapped_before - self.pages.mapped_pages) * self.bundle_bytes
        copied = len(confirmed) * self.block_bytes * self.num_layers * self.num_kv_buffers * self.tp_world
        self._publish()
        result = CompactResult(tuple(confirmed), len(moves), copied, returned)
        if confirmed:
            self.compaction.count(result, time.monotonic_ns() - started)
            self.segment.publish_compaction(self.compaction.values())
        return result

    def _holds_destination(self: _Compacts, block: int) -> bool:
        """A compaction destination is still the one compaction took (used, not cached): the handler did not free it."""
        return self.pages.is_used(block) and block not in self.cache

    def _confirmed(self: _Compacts, moves: list[Move], answer: object) -> list[Move]:
        """The planned moves a compact handler confirmed, checked before any accounting changes.

        A well-formed pair that was never planned is not confirmed (its source stays). Raises ValueError
        (nothing moves) when the answer is not a list of (source, destination) pairs of block ids, or when
        the handler changed a block of a move it confirms (freed or reused its source, freed its
        destination): the allocator frees the sources, the engine only copies and rewrites its ids.
        """
        items = list(answer) if isinstance(answer, (list, tuple)) else None
        if items is None:
            raise ValueError(f"{self.name}: the compact handler returned {type(answer).__name__}, not a list of "
                             f"(source, destination) moves; nothing moved")
        planned = dict(moves)
        confirmed: dict[Move, None] = {}  # in order, an exact repeat counted once
        for item in items:
            pair = tuple(item) if isinstance(item, (tuple, list)) else ()
            if len(pair) != 2 or not all(isinstance(b, Integral) and not isinstance(b, bool) for b in pair):
                raise ValueError(f"{self.name}: the compact handler returned {item!r}, not a (source, destination) "
                                 f"move; nothing moved")
            move = (int(pair[0]), int(pair[1]))
            if planned.get(move[0]) == move[1]:
                confirmed[move] = None
        for src, dst in confirmed:
            if src not in self.cache or not self._holds_destination(dst):
                raise ValueError(f"{self.name}: the compact handler confirmed move ({src}, {dst}) but freed or "
                                 f"reused one of its blocks (the allocator frees the sources); nothing moved")
        return list(confirmed)

    def _compact_idle(self: _Compacts) -> set[int]:
        """Idle packing's first step when the engine registered a compact handler: move the cached blocks into
        fewer pages (the cache is kept); the policy then evicts only what still keeps it above its target.
        Returns the destinations filled."""
        if self._compact_handler is None or not self.cache.blocks or self.policy.pack_ratio is None:
            return set()
        try:
            return {dst for _, dst in self._compact().moves}
        except Exception:  # the engine's copy failed: nothing moved, eviction packs instead
            logging.getLogger(__name__).exception("%s: idle compaction failed; evicting instead", self.name)
            return set()
