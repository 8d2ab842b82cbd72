"""Hypothesis state machine over KVCacheManager on the host backend.

Every rule runs under the manager's lock, so the background refill thread cannot finish a
mapping in the middle of a rule and each rule's outcome can be predicted exactly. After every
rule the invariants compare three views of the allocator: the test's own model of which blocks
it holds, the published segment (a fresh snapshot with its page map), and the bytes written into
each held block (a page that was unmapped while it held blocks would read back as zeros).
"""

from __future__ import annotations

import struct
from collections import Counter

import hypothesis.strategies as st
import pytest
from conftest import configured
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvcached_core import KVCacheManager, request_limit
from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import read_segment

KiB = 1024
PAGE = 64 * KiB
TOKEN = struct.Struct("<Q")
INDEX = st.integers(0, 1 << 16)



class AllocatorMachine(RuleBasedStateMachine):
    """Drives one allocator; ``BOUNDS`` (min, max reserved pages) decide whether the refill thread runs."""

    BOUNDS: tuple[tuple[int, int], ...] = ((0, 0),)

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.active: set[int] = set()
        self.cached: set[int] = set()
        self.tokens: dict[int, int] = {}
        self.next_token = 1
        self.limit: int | None = None

    # -- setup -------------------------------------------------------------------------------
    @initialize(
        num_layers=st.integers(1, 2),
        block_bytes=st.sampled_from([8 * KiB, 16 * KiB, 24 * KiB]),
        num_blocks=st.integers(1, 48),
        budget=st.sampled_from([-1, 0, 1, 3, 8]),
        policy=st.sampled_from(["affinity", "best-fit", "first-fit"]),
        data=st.data(),
    )
    def start(self, num_layers: int, block_bytes: int, num_blocks: int, budget: int, policy: str, data) -> None:
        lo, hi = data.draw(st.sampled_from(self.BOUNDS), label="reserve bounds")
        # No idle return: the watcher would empty the pool between rules; keep each example's pool ours.
        cfg = configured({"KVCACHED_MIN_RESERVED_PAGES": str(lo), "KVCACHED_MAX_RESERVED_PAGES": str(hi),
                          "KVCACHED_MAX_CACHED_BLOCKS": str(budget), "KVCACHED_IDLE_RETURN_S": "-1"})
        self.m = KVCacheManager("sm", num_blocks=num_blocks, block_bytes=block_bytes,
                                num_layers=num_layers, page_size=PAGE, policy=policy, settings=cfg)
        m = self.m
        self.policy = policy
        assert (m.min_reserved, m.max_reserved) == (lo, hi)
        self.budget = None if budget < 0 else budget
        self.bpp = m.blocks_per_page
        pages_total = m.pages.pages_total
        self.caps = [self.bpp] * pages_total
        self.caps[-1] = num_blocks - (pages_total - 1) * self.bpp

    def teardown(self) -> None:
        if self.m is not None:
            path = self.m.segment.path
            self.m.close()
            assert not path.exists(), "close() must unlink the segment"

    # -- helpers -----------------------------------------------------------------------------
    @property
    def live(self) -> set[int]:
        return self.active | self.cached

    def offset(self, block: int) -> int:
        """Byte offset of a block in one layer's buffer: blocks never straddle pages."""
        return (block // self.bpp) * PAGE + (block % self.bpp) * self.m.block_bytes

    def buffers(self):
        m = self.m
        for layer in range(m.num_layers):
            for kv in range(m.num_kv_buffers):
                yield m.buffer(layer, kv)

    def write_tokens(self, ids: list[int]) -> None:
        for view in self.buffers():
            with view:
                for block in ids:
                    off = self.offset(block)
                    view[off:off + 8] = TOKEN.pack(self.tokens[block])

    def take(self, ids: list[int]) -> None:
        for block in ids:
            self.tokens[block] = self.next_token
            self.next_token += 1
        self.active.update(ids)
        self.write_tokens(ids)

    def forget(self, ids) -> None:
        for block in ids:
            self.active.discard(block)
            self.cached.discard(block)
            self.tokens.pop(block, None)

    def expected_available(self, entries: list[tuple[bool, int, int]]) -> int:
        """Blocks alloc could hand out now: free slots on mapped pages plus pages the limit still allows."""
        m = self.m
        free_mapped = sum(self.caps[p] - used for p, (mapped, used, _c) in enumerate(entries) if mapped)
        mapped = sum(1 for mapped, _u, _c in entries if mapped)
        unmapped = sorted(m.pages.unmapped)
        assert len(unmapped) == sum(1 for e in entries if not e[0]) - m.pages.inflight
        headroom = len(unmapped)
        if self.limit is not None:
            headroom = max(0, min(headroom, self.limit // m.bundle_bytes - mapped - m.pages.inflight))
        return free_mapped + sum(self.caps[p] for p in unmapped[:headroom])

    @staticmethod
    def pick(data, pool, max_size: int = 8) -> list[int]:
        """Some members of ``pool``, drawn as indices so the draws never depend on which ids the
        allocator chose (with the refill thread running, that depends on timing)."""
        picks = data.draw(st.lists(INDEX, min_size=1, max_size=max_size), label="picks")
        ordered = sorted(pool)
        return list(dict.fromkeys(ordered[i % len(ordered)] for i in picks)) if ordered else []

    def reserved(self) -> int:
        return len(self.m.pages.reserved)

    # -- engine rules ------------------------------------------------------------------------
    @rule(n=st.integers(1, 20), data=st.data())
    def alloc(self, n: int, data) -> None:
        m = self.m
        near = (self.pick(data, self.live, max_size=1) or [None])[0] if data.draw(st.booleans(), label="near") else None
        with m._lock:
            available = m.available_size()
            used_before = m.used_blocks
            ids = m.alloc(n, near=near)
            if n <= available:
                assert ids is not None, f"alloc({n}) failed with available_size()={available}"
            else:
                assert ids is None, f"alloc({n}) succeeded with available_size()={available}"
            if ids is None:
                assert m.used_blocks == used_before
                return
            assert len(ids) == n == len(set(ids))
            assert not set(ids) & self.live, "a block was handed out twice"
            assert all(0 <= b < m.num_blocks for b in ids)
            self.take(ids)

    @rule()
    def alloc_everything_available(self) -> None:
        m = self.m
        with m._lock:
            n = m.available_size()
            if n:
                ids = m.alloc(n)
                assert ids is not None, f"alloc(available_size()={n}) failed"
                assert not set(ids) & self.live
                self.take(ids)
            assert m.available_size() == 0
            assert m.alloc(1) is None

    @rule(data=st.data())
    def free(self, data) -> None:
        ids = self.pick(data, self.live)
        if not ids:
            return
        with self.m._lock:
            self.m.free(ids)
            self.forget(ids)

    @rule(data=st.data())
    def free_invalid(self, data) -> None:
        m = self.m
        bogus = self.pick(data, [b for b in range(-2, m.num_blocks + 8) if b not in self.live], max_size=1)
        ids = self.pick(data, self.live, max_size=1) + bogus
        with m._lock:
            before = m.used_blocks
            with pytest.raises(ValueError):
                m.free(ids)
            assert m.used_blocks == before, "a rejected free changed something"
            if self.live:
                block = next(iter(self.live))
                with pytest.raises(ValueError):
                    m.free([block, block])
                assert m.used_blocks == before

    @rule(n=st.integers(0, 30))
    def try_to_reserve(self, n: int) -> None:
        m = self.m
        with m._lock:
            available = m.available_size()
            ok = m.try_to_reserve(n)
            assert ok == (n <= available), f"try_to_reserve({n}) -> {ok} with available_size()={available}"
            if ok and n:
                ids = m.alloc(n)
                assert ids is not None, f"alloc({n}) failed right after try_to_reserve({n}) said yes"
                self.take(ids)

    @rule()
    def free_reserved(self) -> None:
        m = self.m
        with m._lock:
            before = self.reserved()
            freed = m.free_reserved()
            after = self.reserved()
            assert after == min(before, m.min_reserved)
            assert freed == (before - after) * m.bundle_bytes

    @rule()
    def trim(self) -> None:
        m = self.m
        with m._lock:
            before = self.reserved()
            freed = m.trim()
            assert freed == before * m.bundle_bytes
            assert self.reserved() == 0

    @rule(choice=st.sampled_from(["none", "zero", "small", "large", "bytes"]), data=st.data())
    def set_limit(self, choice: str, data) -> None:
        m = self.m
        bundle = m.bundle_bytes
        value = {
            "none": None, "zero": 0,
            "small": data.draw(st.integers(1, 2 * bundle), label="small"),
            "large": 2 * bundle * m.pages.pages_total,
            "bytes": data.draw(st.integers(0, bundle * (m.pages.pages_total + 1)), label="bytes"),
        }[choice]
        with m._lock:
            inuse, reserved, inflight = m.pages.pages_inuse, self.reserved(), m.pages.inflight
            status = m.set_limit(value)
            self.limit = value
            if value is None:
                assert status == "none"
                assert self.reserved() == reserved
                return
            pages = value // bundle
            assert status == ("applied" if inuse <= pages else "deferred")
            excess = max(0, inuse + reserved + inflight - pages)
            assert m.pages.pages_inuse == inuse, "set_limit changed the pages in use"
            # A refill batch in flight lands while set_limit waits for it (the wait lets go of the lock); what
            # landed may still be reserved if the bounded wait ran out first (a stuck map stays deferred and
            # is settled when it lands). Without a refill (QuietMachine) nothing lands: the count is exact.
            landed = inflight - m.pages.inflight
            assert reserved - min(excess, reserved) <= self.reserved() <= reserved - min(excess, reserved) + landed

    # -- prefix-cache rules ------------------------------------------------------------------
    @rule(data=st.data())
    def mark_cached(self, data) -> None:
        m = self.m
        ids = self.pick(data, self.live)
        if not ids:
            return
        with m._lock:
            cached_after = self.cached | set(ids)
            active_on = Counter(b // self.bpp for b in self.active - set(ids))
            cached_on = Counter(b // self.bpp for b in cached_after)
            evicted = m.mark_cached(ids)
            assert len(evicted) == len(set(evicted))
            assert set(evicted) <= cached_after, "evicted a block that was not cached"
            over = 0 if self.budget is None else max(0, len(cached_after) - self.budget)
            if self.active - set(ids):
                assert len(evicted) == over
            else:  # the model just went idle: the policy may also give back sparse pages
                assert len(evicted) >= over
            if self.policy == "best-fit" and any(not active_on[p] and c <= over for p, c in cached_on.items()):
                assert not active_on[evicted[0] // self.bpp], "eviction did not start with a wholly cached page"
            self.active -= set(ids)
            self.cached = cached_after
            self.forget(evicted)

    @rule(data=st.data())
    def reuse(self, data) -> None:
        ids = self.pick(data, self.cached)
        if not ids:
            return
        with self.m._lock:
            self.m.reuse(ids)
        self.cached -= set(ids)
        self.active |= set(ids)

    @rule(data=st.data())
    def reuse_invalid(self, data) -> None:
        m = self.m
        bad = [self.pick(data, self.active, max_size=1)] + [[c, c] for c in self.pick(data, self.cached, max_size=1)]
        bad = [ids for ids in bad if ids]
        with m._lock:
            for ids in bad:
                before = m.cached_blocks
                with pytest.raises(ValueError):
                    m.reuse(ids)
                assert m.cached_blocks == before, f"a rejected reuse({ids}) changed the cache"

    @rule(n=st.integers(0, 10))
    def evict(self, n: int) -> None:
        with self.m._lock:
            victims = self.m.evict(n)
        assert len(victims) == len(set(victims)) == min(n, len(self.cached))
        assert set(victims) <= self.cached
        self.forget(victims)

    @rule()
    def pack(self) -> None:
        m = self.m
        with m._lock:
            mapped_before = m.pages.mapped_pages
            victims = m.pack()
            assert len(victims) == len(set(victims)) and set(victims) <= self.cached
            assert m.pages.mapped_pages <= mapped_before
        self.forget(victims)

    # -- the controller path -----------------------------------------------------------------
    @rule(choice=st.sampled_from(["none", "zero", "one", "all"]))
    def controller_limit(self, choice: str) -> None:
        m = self.m
        value = {"none": None, "zero": 0, "one": m.bundle_bytes, "all": m.bundle_bytes * m.pages.pages_total}[choice]
        inuse = m.pages.pages_inuse
        ack = request_limit(m.name, value, wait=10)
        self.limit = value
        assert ack.kind == "limit"
        if value is None:
            assert ack.status == "none" and ack.effective_limit is None
        else:
            assert ack.status == ("applied" if inuse <= value // m.bundle_bytes else "deferred")
            assert ack.effective_limit == value // m.bundle_bytes * m.bundle_bytes

    # -- invariants (under the lock: the published state is the current state) ---------------
    @invariant()
    def everything_agrees(self) -> None:
        m = self.m
        if m is None:
            return
        with m._lock:
            snap = read_segment(m.segment.path, with_pages=True)
            entries = [L.decode_page(e) for e in snap.page_entries()]
            self.check_page_map(snap, entries)
            self.check_limit_and_budget(snap)
            available = m.available_size()
            assert available <= m.num_blocks - m.used_blocks
            assert available == self.expected_available(entries)
            self.check_block_contents()

    def check_page_map(self, snap, entries: list[tuple[bool, int, int]]) -> None:
        """No block twice, no used block on an unmapped page, counters equal to the page map."""
        m = self.m
        assert len(entries) == m.pages.pages_total
        assert not self.active & self.cached
        used_on = Counter(b // self.bpp for b in self.live)
        cached_on = Counter(b // self.bpp for b in self.cached)
        for page, (mapped, used, cached) in enumerate(entries):
            assert used == used_on[page], f"page {page}: map says {used} used, test holds {used_on[page]}"
            assert cached == cached_on[page], f"page {page}: map says {cached} cached, test has {cached_on[page]}"
            assert mapped == bool(m.pages.mapped[page])
            if used:
                assert mapped, f"page {page} holds {used} blocks but is unmapped"
        inuse = sum(1 for mp, u, _ in entries if mp and u)
        reserved = sum(1 for mp, u, _ in entries if mp and not u)
        assert snap.pages_inuse == inuse == m.pages.pages_inuse
        assert snap.pages_reserved == reserved == len(m.pages.reserved)
        assert snap.blocks_used == sum(u for _, u, _ in entries) == len(self.live) == m.used_blocks
        assert snap.blocks_cached == sum(c for _, _, c in entries) == len(self.cached) == m.cached_blocks
        assert snap.mapped_bytes == (inuse + reserved) * m.bundle_bytes
        for block in self.live:
            assert m.pages.is_used(block)

    def check_limit_and_budget(self, snap) -> None:
        m = self.m
        if self.budget is not None:
            assert snap.blocks_cached <= self.budget
        if self.limit is None:
            assert snap.limit_bytes is None and snap.limit_status == "none"
            return
        pages = self.limit // m.bundle_bytes
        assert snap.limit_bytes == pages * m.bundle_bytes
        if snap.pages_inuse <= pages:
            assert snap.limit_status == "applied"
            assert snap.mapped_bytes <= snap.limit_bytes, "mapped above an applied limit"
        else:
            assert snap.limit_status == "deferred"
            assert snap.pages_reserved == 0, "kept reserved pages while over the limit"

    def check_block_contents(self) -> None:
        """A page that was unmapped while it held blocks reads back as zeros."""
        for view in self.buffers():
            with view:
                for block in self.live:
                    off = self.offset(block)
                    got = TOKEN.unpack(view[off:off + 8])[0]
                    assert got == self.tokens[block], f"block {block} lost its contents"


class QuietMachine(AllocatorMachine):
    """No reserve minimum: the refill thread never maps, everything happens in the rules."""

    BOUNDS = ((0, 0), (0, 1), (0, 3))


class RefillMachine(AllocatorMachine):
    """A reserve minimum: the refill thread maps pages in the background between rules."""

    BOUNDS = ((1, 2), (2, 4), (3, 3))


SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_allocator_invariants_without_refill() -> None:
    run_state_machine_as_test(QuietMachine, settings=SETTINGS)


def test_allocator_invariants_with_background_refill() -> None:
    run_state_machine_as_test(RefillMachine, settings=SETTINGS)
