"""Placement and eviction policies: where new blocks go, which cached blocks leave first.

Memory returns one page at a time and only when every block on it is free, so these choices
decide what an idle model still pins. A policy is chosen per allocator
(``KVCacheManager(policy=...)``, else ``KVCACHED_POLICY``, else ``affinity``):

``first-fit``
    A naive baseline: every block goes to the lowest-numbered page with a free slot;
    eviction is plain LRU.
``best-fit``
    The upstream kvcached policy: a request's run goes to the fullest page that takes it
    whole (whole pages for whole-page chunks), else an empty page. At the cache cap it
    evicts whole pages (all of whose used blocks are cached), cheapest first and least
    recently used among equals, then tops up in LRU order.
``affinity`` (the default)
    As best-fit, plus three things. (1) A request's next blocks go to the page of its last
    block (``alloc(n, near=block)``); when that page is full, a decode stream opens a page of
    its own while the free slots on in-use pages stay under ``slack`` of the blocks in use.
    So a request's blocks share pages with few others, and they become cached, and leave,
    together. (2) Eviction looks only at the oldest quarter of the cache: whole pages
    first (cheapest, then least recently used), then the oldest blocks, so it empties pages
    without evicting young blocks that upstream's cheapest-page rule would take.
    (3) When the model goes idle (no active block left) it evicts the cached blocks of its
    sparsest pages until it pins at most ``pack_ratio`` x its packed floor, and unmaps them.

Whatever the policy, while a lowered limit is deferred the allocator places with
:func:`place_draining` (fullest pages first) so that sparse pages empty and the limit applies, and
:func:`drain_victims` names the cached blocks whose eviction lets it apply now.

Nothing here moves a block. A policy only chooses; the allocator applies the choices under
its lock and publishes them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from ..settings import default_of, settings
from .pages import PageTable
from .prefix_cache import PrefixCache

EmptyPage = Callable[[], "int | None"]


class Policy:
    """``best-fit``: upstream kvcached's placement and page-aware eviction; no idle packing."""

    name = "best-fit"
    pack_ratio: float | None = None  # idle packing target (pinned / packed floor); None: off

    # -- placement ---------------------------------------------------------------------------
    def place(self, pages: PageTable, n: int, empty_page: EmptyPage, taken: list[int],
              near: int | None = None) -> bool:
        """Append ``n`` block ids to ``taken``; False (with what was taken) when pages ran out."""
        bpp = pages.bpp
        remaining = n
        while remaining >= bpp:  # whole pages for whole-page chunks of the run
            page = empty_page()
            if page is None:
                break
            got = pages.take_blocks(page, min(pages.cap[page], remaining))
            taken += got
            remaining -= len(got)
        if not remaining:
            return True
        page = pages.best_fit(remaining)
        if page is None:
            page = empty_page()
        if page is None:  # no page takes the rest whole and none is empty: split it over the holes
            page = pages.emptiest()
        while page is not None:
            got = pages.take_up_to(page, remaining)
            taken += got
            remaining -= len(got)
            if not remaining:
                return True
            page = pages.emptiest()
            if page is None:
                page = empty_page()
        return False

    # -- eviction ----------------------------------------------------------------------------
    def victims(self, cache: PrefixCache, n: int, pages: PageTable) -> list[int]:
        """Up to ``n`` cached blocks to evict: whole pages that fit in ``n``, cheapest first, then LRU."""
        if n <= 0 or not cache.blocks:
            return []
        return _whole_pages_then_lru(cache, n, pages, cutoff=None)

    def pack(self, cache: PrefixCache, pages: PageTable) -> list[int]:
        """Cached blocks to give back on idle: the sparsest whole pages until pinned <= pack_ratio x floor."""
        if self.pack_ratio is None or not cache.blocks:
            return []
        bpp = pages.bpp
        pinned, held = pages.pages_inuse, pages.blocks_used
        if pinned <= self.pack_ratio * -(-held // bpp):
            return []
        candidates = sorted(whole_cached_pages(cache, pages))
        victims: list[int] = []
        for cost, _age, page in candidates:
            if pinned <= self.pack_ratio * -(-held // bpp):
                break
            victims += cache.by_page[page]
            pinned -= 1
            held -= cost
        return victims


def whole_cached_pages(cache: PrefixCache, pages: PageTable) -> list[tuple[int, int, int]]:
    """(cached blocks, newest block's age, page) of every page all of whose used blocks are cached: the pages
    an eviction empties, and so returns. Sorting them puts the cheapest first, least recently used among equals."""
    used = pages.used
    return [(len(on_page), next(reversed(on_page.values())), page)
            for page, on_page in cache.by_page.items() if len(on_page) == used[page]]


def _whole_pages_then_lru(cache: PrefixCache, n: int, pages: PageTable, cutoff: int | None) -> list[int]:
    """Whole pages (no active block; newest cached block not younger than ``cutoff``) that fit in
    ``n``, cheapest first and least recently used among equals; then the oldest blocks."""
    whole = sorted(w for w in whole_cached_pages(cache, pages) if cutoff is None or w[1] <= cutoff)
    victims: list[int] = []
    for cost, _age, page in whole:
        if len(victims) + cost > n:
            if cutoff is None:
                break  # upstream stops at the first page that does not fit
            continue
        victims += cache.by_page[page]
    if len(victims) < n:
        chosen = set(victims)
        for block in cache.blocks:
            if block not in chosen:
                victims.append(block)
                if len(victims) == n:
                    break
    return victims


class FirstFit(Policy):
    """``first-fit``: lowest-numbered page with a free slot, block after block; LRU eviction."""

    name = "first-fit"

    def place(self, pages: PageTable, n: int, empty_page: EmptyPage, taken: list[int],
              near: int | None = None) -> bool:
        remaining = n
        while remaining:
            page = pages.lowest_open()
            if page is not None and pages.used[page] == 0:
                pages.take_reserved(page)
            elif page is None:
                page = empty_page()
                if page is None:
                    return False
            got = pages.take_up_to(page, remaining)
            taken += got
            remaining -= len(got)
        return True

    def victims(self, cache: PrefixCache, n: int, pages: PageTable) -> list[int]:
        return cache.oldest(n) if n > 0 else []


class Affinity(Policy):
    """``affinity``: keep each request on its own pages, evict old whole pages, pack on idle."""

    name = "affinity"
    pack_ratio = 1.10
    slack = 0.35  # a decode stream may open a page while open slots stay under this share of used blocks
    window = 0.25  # eviction considers the oldest quarter of the cache (at least 2n blocks)

    def place(self, pages: PageTable, n: int, empty_page: EmptyPage, taken: list[int],
              near: int | None = None) -> bool:
        if near is not None and 0 <= near < len(pages.block_used):
            page = near // pages.bpp
            if pages.used[page] and pages.used[page] < pages.cap[page]:
                got = pages.take_up_to(page, n)
                taken += got
                n -= len(got)
                if not n:
                    return True
            if n == 1 and pages.open_slots() + pages.bpp <= self.slack * pages.blocks_used:
                opened = empty_page()
                if opened is not None:
                    taken += pages.take_blocks(opened, 1)
                    return True
        return super().place(pages, n, empty_page, taken)

    def victims(self, cache: PrefixCache, n: int, pages: PageTable) -> list[int]:
        if n <= 0 or not cache.blocks:
            return []
        size = max(2 * n, int(len(cache.blocks) * self.window))
        return _whole_pages_then_lru(cache, n, pages, cutoff=cache.age_of_oldest(size))


def place_draining(pages: PageTable, n: int, taken: list[int]) -> bool:
    """Placement while a lowered limit waits for pages to empty: the fullest pages first.

    Keeping a run together would often put it on a nearly empty page and keep that page
    pinned; packing into the fullest pages lets the sparse ones drain, so the limit applies.
    Never maps a page (the limit already forbids it), whatever the model's policy.
    """
    while n:
        page = pages.best_fit(1)
        if page is None:
            return False
        got = pages.take_up_to(page, n)
        taken += got
        n -= len(got)
    return True


def drain_victims(cache: PrefixCache, pages: PageTable, limit_pages: int) -> list[int]:
    """The cached blocks to evict so that a deferred limit applies: whole cached pages (no active block on
    them), the cheapest first (fewest cached blocks lost per page returned), least recently used among
    equals, and only as many pages as are in use over the limit.

    A page that also holds an active block is left alone: evicting its cached blocks would give nothing
    back until that request ends, and then it is a whole cached page, taken at the next look.
    """
    over = pages.pages_inuse - limit_pages
    if over <= 0 or not cache.blocks:
        return []
    victims: list[int] = []
    for _cost, _age, page in heapq.nsmallest(over, whole_cached_pages(cache, pages)):
        victims += cache.by_page[page]
    return victims


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FirstFit, Policy, Affinity)}
DEFAULT_POLICY = default_of("KVCACHED_POLICY")


def make_policy(policy: str | Policy | None) -> Policy:
    """A policy instance from a name (``KVCACHED_POLICY`` when None) or an instance."""
    if isinstance(policy, Policy):
        return policy
    if policy is None:
        policy = settings().policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown placement policy {policy!r}: use one of {', '.join(POLICIES)}") from None
