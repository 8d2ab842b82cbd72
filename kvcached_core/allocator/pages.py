"""Page and block bookkeeping for one model: which pages are mapped, which slots are used.

Partly used pages are indexed by their number of free slots, so a placement policy
(:mod:`kvcached_core.allocator.placement`) finds the best-fitting (fullest) page in a few set lookups.
Empty mapped pages are the reserve pool. This module does no I/O and makes no placement
decisions; the allocator holds its lock around every call. The containers are never replaced,
only changed in place: the C alloc path (:mod:`kvcached_core.allocator.fastpath`) holds them.
"""

from __future__ import annotations

import heapq


class PageTable:
    """Pure bookkeeping, no I/O; the allocator holds its lock around every call."""

    def __init__(self, pages_total: int, blocks_per_page: int, num_blocks: int) -> None:
        self.pages_total = pages_total
        self.bpp = blocks_per_page
        self.cap = [blocks_per_page] * pages_total
        if pages_total:
            self.cap[-1] = num_blocks - (pages_total - 1) * blocks_per_page
        self.used = [0] * pages_total
        self.mapped = bytearray(pages_total)
        self.slots: list[list[int] | None] = [None] * pages_total
        self.unmapped = list(range(pages_total))  # a heap: low page ids first keeps the map compact
        self.reserved: list[int] = []  # mapped, no block used (the warm pool), LIFO
        self.inflight = 0  # taken from ``unmapped`` and being mapped right now
        self.partial: list[set[int]] = [set() for _ in range(blocks_per_page + 1)]  # by free slots
        self.nonempty = 0  # bit f set while partial[f] holds a page: best fit without a scan
        self.pages_inuse = 0
        self.blocks_used = 0
        self.block_used = bytearray(pages_total * blocks_per_page)  # 1 while handed out
        self.touched: set[int] = set()  # pages whose blocks changed since the allocator last published

    # -- page states -------------------------------------------------------------------------
    @property
    def mapped_pages(self) -> int:
        return self.pages_inuse + len(self.reserved)

    def take_unmapped(self, count: int) -> list[int]:
        pages = [heapq.heappop(self.unmapped) for _ in range(min(count, len(self.unmapped)))]
        self.inflight += len(pages)
        return pages

    def finish_mapping(self, asked: list[int], mapped: list[int]) -> None:
        """Mapped pages join the pool; those the backend refused go back to ``unmapped``."""
        self.inflight -= len(asked)
        done = set(mapped)
        for page in asked:
            if page in done:
                self.mapped[page] = 1
                self.slots[page] = list(range(self.cap[page] - 1, -1, -1))
                self.reserved.append(page)
            else:
                heapq.heappush(self.unmapped, page)

    def take_reserved(self, page: int | None = None) -> int | None:
        """A pool page: the most recently pooled one, or ``page`` itself."""
        if page is not None:
            self.reserved.remove(page)
            return page
        return self.reserved.pop() if self.reserved else None

    def release_reserved(self, count: int) -> list[int]:
        """Remove up to ``count`` pool pages (coldest first) for unmapping."""
        count = min(count, len(self.reserved))
        pages = self.reserved[:count]
        del self.reserved[:count]  # in place: the C alloc path holds this list
        return pages

    def mark_unmapped(self, pages: list[int]) -> None:
        for page in pages:
            self.mapped[page] = 0
            self.slots[page] = None
            heapq.heappush(self.unmapped, page)

    # -- blocks ------------------------------------------------------------------------------
    def free_slots(self, page: int) -> int:
        return self.cap[page] - self.used[page]

    def _unlist(self, page: int, free: int) -> None:
        bucket = self.partial[free]
        bucket.discard(page)
        if not bucket:
            self.nonempty &= ~(1 << free)

    def _list(self, page: int, free: int) -> None:
        self.partial[free].add(page)
        self.nonempty |= 1 << free

    def take_up_to(self, page: int, n: int) -> list[int]:
        """As many of ``n`` blocks as a mapped page has free; returns their ids."""
        return self.take_blocks(page, min(self.free_slots(page), n))

    def take_blocks(self, page: int, count: int) -> list[int]:
        """Use ``count`` free slots of a mapped page; returns block ids."""
        before = self.used[page]
        cap = self.cap[page]
        if before == 0:
            self.pages_inuse += 1
        else:
            self._unlist(page, cap - before)
        slots = self.slots[page]
        assert slots is not None and len(slots) >= count
        base = page * self.bpp
        ids = [base + slots.pop() for _ in range(count)]
        flags = self.block_used
        for block in ids:
            flags[block] = 1
        self.touched.add(page)
        self.used[page] = before + count
        self.blocks_used += count
        if cap > before + count:
            self._list(page, cap - before - count)
        return ids

    def take_block(self, block: int) -> None:
        """Use one chosen free slot of a mapped page (a compaction destination)."""
        page = block // self.bpp
        slots = self.slots[page]
        assert slots is not None and not self.block_used[block]
        before, cap = self.used[page], self.cap[page]
        if before == 0:
            self.pages_inuse += 1
        else:
            self._unlist(page, cap - before)
        slots.remove(block - page * self.bpp)
        self.block_used[block] = 1
        self.touched.add(page)
        self.used[page] = before + 1
        self.blocks_used += 1
        if cap > before + 1:
            self._list(page, cap - before - 1)

    def free_blocks(self, blocks) -> dict[int, int]:  # any iterable of ints
        """Return blocks' slots; returns {page: blocks freed there}. A page with ``used == 0`` emptied."""
        bpp, flags, slots = self.bpp, self.block_used, self.slots
        per_page: dict[int, int] = {}
        for block in blocks:
            page = block // bpp
            flags[block] = 0
            slots[page].append(block - page * bpp)
            per_page[page] = per_page.get(page, 0) + 1
        used, cap = self.used, self.cap
        for page, count in per_page.items():
            before = used[page]
            if before != cap[page]:
                self._unlist(page, cap[page] - before)
            used[page] = before - count
            if before == count:
                self.pages_inuse -= 1
            else:
                self._list(page, cap[page] - before + count)
        self.blocks_used -= sum(per_page.values())
        return per_page

    def is_used(self, block: int) -> bool:
        """True when ``block`` is currently handed out."""
        return 0 <= block < len(self.block_used) and self.block_used[block] == 1

    def best_fit(self, count: int) -> int | None:
        """The in-use page with the fewest free slots that still holds ``count`` blocks (lowest id among equals)."""
        fits = self.nonempty >> count
        if not fits:
            return None
        return min(self.partial[count + (fits & -fits).bit_length() - 1])

    def emptiest(self) -> int | None:
        """The in-use page with the most free slots (lowest id among equals)."""
        if not self.nonempty:
            return None
        return min(self.partial[self.nonempty.bit_length() - 1])

    def lowest_open(self) -> int | None:
        """The lowest-numbered mapped page with a free slot, in use or in the pool (first fit)."""
        best = min(self.reserved) if self.reserved else None
        for bucket in self.partial[1:]:
            if bucket:
                low = min(bucket)
                if best is None or low < best:
                    best = low
        return best

    def open_slots(self) -> int:
        """Free slots on in-use pages: what placement has left unfilled (bounded by page caps)."""
        return self.pages_inuse * self.bpp - self.blocks_used

    def free_in_mapped(self) -> int:
        """Blocks that can be handed out without mapping anything."""
        partial = sum(free * len(b) for free, b in enumerate(self.partial))
        return partial + sum(self.cap[p] for p in self.reserved)
