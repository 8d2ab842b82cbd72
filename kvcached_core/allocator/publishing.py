"""What the allocator publishes in its segment: its state under the seqlock, and the engine's own figures.

:class:`Publishing` is one face of :class:`~kvcached_core.allocator.manager.KVCacheManager` (a base class of it):
its methods are the manager's own; it never imports the manager.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from ..segment import layout as L
from .served import Served


class _Publishes(Served, Protocol):
    """What publishing reaches of the allocator."""

    requested_limit: int
    evicted_blocks: int
    alloc_blocks: int
    free_blocks: int
    blocks_per_page: int
    _fast: Any
    _budget_short: bool
    _schedulable: int

    def _refused(self, nbytes: int) -> None: ...
    def _rank_records(self) -> Sequence[tuple[int, ...]]: ...
    def _publish_python(self) -> None: ...


class Publishing:
    """The manager's publishing methods (see the module docstring)."""

    @property
    def state_seq(self: _Publishes) -> int:
        """Changes whenever the published state changes (odd while a publish is under way): an engine that
        asks ``schedulable_blocks`` many times a step can keep the answer until this moves."""
        return self.segment.current_seq()

    def publish_endpoint(self: _Publishes, url: str) -> None:
        """Publish where the engine serves this model (an OpenAI-compatible server, ``http://HOST:PORT``) for
        routers and readers (``kvctl route``, ``kvctl show``); ValueError for a URL a segment cannot hold."""
        if not self._closed:
            self.segment.publish_endpoint(url)

    def publish_groups(self: _Publishes, groups: Sequence[tuple[str, int | None, int, int, int, int]]) -> None:
        """Publish the engine's KV cache groups for kvtop and kvctl: per group (shape, window in tokens or None,
        layers, blocks active, blocks cached, pages holding any of its blocks); a shape is one of
        ``layout.GROUP_SHAPE_NAMES``' names. ValueError for figures a segment cannot hold."""
        codes = L.GROUP_SHAPE_CODES
        records = []
        for shape, window, layers, active, cached, pages in groups:
            if shape not in codes:
                raise ValueError(f"KV cache group shape {shape!r} is not one of {', '.join(codes)}")
            records.append((codes[shape], window or 0, layers, active, cached, pages))
        if not self._closed:
            self.segment.publish_groups(records)

    def publish_traffic(self: _Publishes, running: int, waiting: int, finished: int, prompt_tokens: int,
                        generated_tokens: int, preemptions: int, last_request_ns: int,
                        waiting_blocks: int = 0) -> None:
        """The engine's request figures, for kvtop and kvctl: gauges (running, waiting) and monotonic
        counters, written into the segment as plain words (no lock, no system call: once a step is cheap).
        Each call is activity for the idle clocks (after-idle sleep, idle return): a model whose requests
        decode without taking a new block is not idle.

        ``waiting_blocks``: the blocks the waiting requests need (0: unknown, taken as one page's worth). While
        the shared budget holds them back, the model asks the other models for what they lack."""
        self.traffic_published += 1
        if not self._closed:
            self.segment.publish_traffic(running, waiting, finished, prompt_tokens, generated_tokens, preemptions,
                                         last_request_ns)
            if waiting and self._budget_short:
                # Requests wait while the shared budget, not the model's limit, holds the engine back: that is a
                # refused growth too, although no alloc was tried (the engine schedules by schedulable_blocks).
                lacking = max(1, waiting_blocks - self._schedulable)
                need = -(-lacking // self.blocks_per_page) * self.bundle_bytes
                if need > self.pressure.wanted:
                    with self._lock:
                        if not self._closed:
                            self._refused(need)

    def _publish(self: _Publishes) -> None:
        """Publish the state under the seqlock: the pages changed since the last publish, every counter.

        With the C path attached, its ``publish`` (fastpath.c) writes the same bytes
        (tests/test_fastpath.py compares them) without the interpreter inside the seqlock window:
        on a busy host that window is what a preemption lands in (the publish's p99.9,
        benchmarks/publish.py). :meth:`_publish_python` is the reference, and the path without C.
        """
        fast = self._fast
        if fast is not None:
            fast.publish()
        else:
            self._publish_python()

    def _rank_records(self: _Publishes) -> Sequence[tuple[int, ...]]:
        """Each rank's record for the segment (``layout.RANK_FIELDS``): tensor parallelism only."""
        return self.backend.rank_records() if self.tp_world > 1 else ()  # type: ignore[attr-defined]

    def _publish_python(self: _Publishes) -> None:
        seg, pages, cached_by_page = self.segment, self.pages, self.cache.by_page
        seg.begin()
        dirty = self._dirty
        if dirty:
            mapped, used, set_page = pages.mapped, pages.used, seg.set_page
            for page in dirty:  # layout.page_entry, inlined: this runs on every alloc and free
                on_page = cached_by_page.get(page)
                set_page(page, (L.PAGE_MAPPED if mapped[page] else 0) | used[page]
                         | ((len(on_page) << L.PAGE_CACHED_SHIFT) if on_page else 0))
            dirty.clear()
        ranks = self._rank_records()
        for index, record in enumerate(ranks):
            seg.set_rank(index, *record)
        effective = -1 if self.limit_pages is None else self.limit_pages * self.bundle_bytes
        seg.publish((
            pages.pages_inuse, len(pages.reserved), pages.blocks_used, len(self.cache),
            pages.mapped_pages * self.bundle_bytes, self.alloc_count, self.free_count,
            self.alloc_blocks, self.free_blocks, self.evicted_blocks, time.time_ns(),
            self.limit_status, int(self._closed), effective, self.applied_revision,
            self.trim_ack_seq, self.trim_bytes, self.requested_limit, self.trimmed_total,
            self.idle_returned, max(1, len(ranks)),
        ))
