"""The C alloc path against the Python one: same blocks, same page table, same segment bytes."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from conftest import configured
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached_core import KVCacheManager
from kvcached_core.allocator import fastpath
from kvcached_core.allocator.placement import POLICIES, Affinity
from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import snapshot
from kvcached_core.settings import ConfigError, Settings

MODULE, WHY = fastpath.load()
needs_build = pytest.mark.skipif(MODULE is None, reason=f"C alloc path unavailable here: {WHY}")

BPP = 8  # 16 KiB blocks on 128 KiB pages
SKIP = {L.COUNTERS_OFF + 8 * L.COUNTER_FIELDS.index("updated_ns")}  # the clock differs; so does the checksum


# No background mapping or idle return: every page is mapped by alloc itself, so runs repeat exactly.
DETERMINISTIC = {"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "2", "KVCACHED_IDLE_RETURN_S": "-1"}


def pair(policy: str, pages: int = 24, bpp: int = BPP,
         env: Mapping[str, str] | None = None) -> tuple[KVCacheManager, KVCacheManager]:
    """The same allocator twice, on the C path and on the Python path; ``env``: their other settings."""
    made = []
    for mode in ("1", "0"):
        made.append(KVCacheManager(f"fp-{mode}", num_blocks=bpp * pages - 3, block_bytes=16 << 10, num_layers=1,
                                   page_size=bpp * (16 << 10), policy=policy,
                                   settings=configured({**(env or {}), "KVCACHED_FASTPATH": mode})))
    fast, slow = made
    assert fast._fast is not None and slow._fast is None, fast.fastpath_reason
    return fast, slow


def small(name: str, pages: int = 8, cls: type[KVCacheManager] = KVCacheManager,
          env: Mapping[str, str] | None = None) -> KVCacheManager:
    """A one-layer manager of ``pages`` pages of BPP 16 KiB blocks; ``env``: its settings (KVCACHED_...)."""
    return cls(name, num_blocks=BPP * pages, block_bytes=16 << 10, num_layers=1, page_size=BPP * (16 << 10),
               settings=configured(env or {}))


def state(m: KVCacheManager) -> tuple:
    p = m.pages
    buf = bytes(m.segment._buf)
    counters = bytearray(buf[L.COUNTERS_OFF:L.CHECKSUM_OFF])
    for off in SKIP:
        counters[off - L.COUNTERS_OFF:off - L.COUNTERS_OFF + 8] = bytes(8)
    page_map = buf[L.PAGE_MAP_OFF:L.PAGE_MAP_OFF + 4 * p.pages_total]
    return (list(p.used), list(p.reserved), [sorted(b) for b in p.partial], p.nonempty, p.slots, bytes(p.block_used),
            p.pages_inuse, p.blocks_used, sorted(p.unmapped), m.alloc_count, m.alloc_blocks, bytes(counters), page_map,
            m.segment.page_sum, m.segment._seq)


alloc_op = st.tuples(st.just("alloc"), st.integers(1, 200), st.integers(-40, 40))  # half without a hint
ops = st.lists(st.one_of(
    alloc_op, alloc_op, alloc_op,
    st.tuples(st.just("free"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("free"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("cache"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("free-cached"), st.integers(0, 30), st.just(0)),  # a request whose blocks were cached
    st.tuples(st.just("evict"), st.integers(1, 12), st.just(0)),
    st.tuples(st.just("limit"), st.integers(-1, 12), st.just(0)),
), min_size=10, max_size=80)


@needs_build
@pytest.mark.parametrize(("policy", "bpp"), [("affinity", 8), ("best-fit", 8), ("first-fit", 8), ("affinity", 64),
                                           ("affinity", 80), ("first-fit", 80)])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_same_blocks_and_bytes(policy: str, bpp: int, script: list) -> None:
    """Pages of 8, 64 and 80 blocks: the C path finds buckets by bitmask up to 64, by scanning above."""
    fast, slow = pair(policy, bpp=bpp, env=DETERMINISTIC)
    held: list[list[int]] = []  # active requests' blocks
    cached: list[list[int]] = []  # cached requests' blocks, minus those evicted since
    try:
        for op, a, b in script:
            results = []
            for m in (fast, slow):
                if op == "alloc":
                    near = None if b < 0 or not held else held[b % len(held)][-1]
                    results.append(m.alloc(a % (3 * bpp + 2) + 1, near=near))
                elif op == "free" and held:
                    m.free(held[a % len(held)])
                elif op == "free-cached" and cached:
                    m.free(cached[a % len(cached)])
                elif op == "cache" and held:
                    results.append(m.mark_cached(held[a % len(held)]))
                elif op == "evict":
                    results.append(m.evict(a))
                elif op == "limit":
                    results.append(m.set_limit(None if a < 0 else a * m.bundle_bytes))
            assert results[:1] == results[1:], (op, a, b)
            if op == "alloc" and results[0] is not None:
                held.append(results[0])
            elif op in ("free", "cache") and held:
                done = held.pop(a % len(held))
                if op == "cache":
                    cached.append(done)
            elif op == "free-cached" and cached:
                cached.pop(a % len(cached))
            if op in ("cache", "evict") and results and results[0]:
                gone = set(results[0])
                cached = [[x for x in ids if x not in gone] for ids in cached]
            assert state(fast) == state(slow), (op, a, b)
        snap = snapshot(fast.name)  # the reader checks the seqlock and the checksum the C path wrote
        assert snap.blocks_used == fast.pages.blocks_used
    finally:
        fast.close()
        slow.close()


@needs_build
def test_alloc_publishes_at_once() -> None:
    with small("fp-live", env={**DETERMINISTIC, "KVCACHED_FASTPATH": "1"}) as m:
        ids = m.alloc(BPP + 3)
        snap = snapshot(m.name)
        assert (snap.blocks_used, snap.pages_inuse, snap.alloc_count) == (BPP + 3, 2, 1)
        assert sorted(b // BPP for b in ids) == [0] * BPP + [1] * 3


def test_every_policy_is_served_in_c_and_off_or_a_policy_of_ones_own_stays_in_python() -> None:
    auto = configured({"KVCACHED_FASTPATH": "auto"})
    for policy in POLICIES:
        with KVCacheManager("fp-pol", num_blocks=64, block_bytes=16 << 10, num_layers=1, page_size=128 << 10,
                            policy=policy, settings=auto) as m:
            assert (m._fast is not None) == (MODULE is not None), (policy, m.fastpath_reason)

    class Mine(Affinity):
        name = "mine"

    with KVCacheManager("fp-mine", num_blocks=64, block_bytes=16 << 10, num_layers=1, page_size=128 << 10,
                        policy=Mine(), settings=auto) as m:
        assert m._fast is None and "'mine' runs in Python" in m.fastpath_reason
        assert m.alloc(3) is not None
    with KVCacheManager("fp-off", num_blocks=64, block_bytes=16 << 10, num_layers=1, page_size=128 << 10,
                        settings=configured({"KVCACHED_FASTPATH": "0"})) as m:
        assert m._fast is None and m.fastpath_reason == "KVCACHED_FASTPATH=0"
        assert m.alloc(3) is not None


def test_bad_mode_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="KVCACHED_FASTPATH='maybe' must be auto, 1 or 0"):
        Settings.from_env({"KVCACHED_FASTPATH": "maybe"}).mode(fastpath.FASTPATH_ENV)


@needs_build
@pytest.mark.parametrize("policy", ["affinity", "best-fit"])
def test_ties_go_to_the_lowest_page(policy: str) -> None:
    """Two pages with the same free slots: both paths fill the lower one first (the placement rule)."""
    fast, slow = pair(policy, env=DETERMINISTIC)
    try:
        for m in (fast, slow):
            assert [b // BPP for b in m.alloc(5) + m.alloc(5)] == [0] * 5 + [1] * 5
            assert [b // BPP for b in m.alloc(2)] == [0, 0]
            assert [b // BPP for b in m.alloc(BPP + 1)] == [2] * BPP + [0]  # a whole page, then the fullest page that fits
        assert state(fast) == state(slow)
    finally:
        fast.close()
        slow.close()


@needs_build
@pytest.mark.parametrize("bpp", [8, 64, 80])
def test_a_whole_page_request_that_cannot_grow(bpp: int) -> None:
    """A limit stops growth and a page's worth of blocks is asked for: both paths fill what is mapped,
    find it short and give everything back (a 64-block page once sent the C path past its buckets)."""
    fast, slow = pair("affinity", pages=4, bpp=bpp, env=DETERMINISTIC)
    try:
        for m in (fast, slow):
            assert m.alloc(10) is not None
            m.set_limit(m.bundle_bytes)
            assert m.alloc(bpp) is None
            assert m.alloc(bpp - 10) is not None  # exactly what is left
        assert state(fast) == state(slow)
    finally:
        fast.close()
        slow.close()


@needs_build
@pytest.mark.parametrize("bad", [[3, 3], [999999], [-1], [5, 0, 5], ["x"]])
def test_a_bad_free_changes_nothing_on_either_path(bad: list) -> None:
    fast, slow = pair("affinity", env=DETERMINISTIC)
    try:
        messages = []
        for m in (fast, slow):
            ids = m.alloc(6)
            assert ids == list(range(6))
            before = state(m)
            with pytest.raises(ValueError) as err:
                m.free([b if isinstance(b, str) else b for b in bad])
            messages.append(str(err.value))
            assert state(m) == before and m.pages.block_used[:6] == b"\x01" * 6
            m.free(ids)  # and the good ones still free
        assert messages[0] == messages[1] and "is not allocated (or listed twice); nothing was changed" in messages[0]
        assert state(fast) == state(slow)
    finally:
        fast.close()
        slow.close()


@needs_build
def test_a_page_table_that_disagrees_with_itself_raises_instead_of_crashing() -> None:
    """The C path bounds-checks what it reads from the Python objects: damage them and it raises."""
    with small("fp-damaged", env={**DETERMINISTIC, "KVCACHED_FASTPATH": "1"}) as m:
        m.alloc(3)
        m.pages.reserved.append(10**6)  # a pool page that does not exist
        with pytest.raises(RuntimeError, match="pool page 1000000 out of range"):
            m.alloc(BPP)
        m.pages.reserved.pop()
        m.pages.partial[BPP - 3].add(-7)  # a bucket holding no real page
        with pytest.raises(RuntimeError, match="bucket page -7 out of range"):
            m.alloc(2)


@needs_build
def test_alloc_is_the_c_entry_and_hands_the_rest_to_python() -> None:
    """The manager's alloc is the C entry (lock and all); odd arguments and a closed manager get
    the Python method's answers."""
    m = small("fp-entry", env={**DETERMINISTIC, "KVCACHED_FASTPATH": "1"})
    assert m.alloc.__name__ == "manager_alloc"
    assert m.alloc(0) == [] and m.alloc(-3) == []
    first = m.alloc(2)
    assert m.alloc(1, near=first[-1]) == [first[-1] + 1]  # the hint is a keyword, as in Python
    assert len(m.alloc(1, near=True)) == 1  # not a plain int: the Python method serves it
    with pytest.raises(TypeError):
        m.alloc(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        m.alloc(1, 2)  # type: ignore[misc]  # near is keyword-only on both paths
    with pytest.raises(TypeError):
        m.alloc(1, nearby=3)  # type: ignore[call-arg]
    assert m.alloc(10**30) is None  # beyond any page table: a miss, as in Python
    assert snapshot(m.name).alloc_count == 3
    m.close()
    assert "alloc" not in m.__dict__
    with pytest.raises(RuntimeError, match="is closed"):
        m.alloc(1)


@needs_build
def test_the_c_entry_holds_the_lock_and_lets_go_on_errors() -> None:
    import threading
    with small("fp-lock", env={**DETERMINISTIC, "KVCACHED_FASTPATH": "1"}) as m:
        got: list = []
        worker = threading.Thread(target=lambda: got.append(m.alloc(1)))
        with m._lock:
            worker.start()
            worker.join(timeout=0.2)
            assert worker.is_alive() and not got  # it waits for the lock
        worker.join(timeout=5)
        assert got and len(got[0]) == 1
        m.pages.reserved.append(10**6)  # damage: the C placement raises inside the lock
        with pytest.raises(RuntimeError, match="out of range"):
            m.alloc(BPP)
        m.pages.reserved.pop()
        other = threading.Thread(target=lambda: got.append(m.alloc(1)))
        other.start()
        other.join(timeout=5)
        assert not other.is_alive() and len(got) == 2  # the lock was released with the error


@needs_build
def test_the_c_entry_asks_for_a_refill() -> None:
    """Draining the pool below its minimum wakes the refill thread, which maps pages again."""
    import time

    with small("fp-refill", pages=16, env={"KVCACHED_FASTPATH": "1", "KVCACHED_MIN_RESERVED_PAGES": "2", "KVCACHED_MAX_RESERVED_PAGES": "4"}) as m:
        assert not m.pages.reserved  # the pool fills once traffic comes
        assert m.alloc(3 * BPP) is not None  # maps its pages itself, then asks for the pool
        deadline = time.monotonic() + 5
        while len(m.pages.reserved) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(m.pages.reserved) >= 2, "the refill thread was not asked"


@needs_build
def test_the_c_entry_has_alloc_s_signature() -> None:
    import inspect
    with small("fp-sig", pages=4, env={"KVCACHED_FASTPATH": "1"}) as m:
        assert str(inspect.signature(m.alloc)) == "(n, *, near=None)"
        assert len(m.alloc(n=2)) == 2  # n by keyword: the Python method serves it


@needs_build
def test_odd_hints_and_subclasses_behave_as_in_python() -> None:
    """A hint beyond any block is ignored on both paths; a subclass's own alloc is not bypassed."""
    fast, slow = pair("affinity", env=DETERMINISTIC)
    try:
        got = [[m.alloc(2), m.alloc(1, near=2**70), m.alloc(1, near=-2**70), m.alloc(3, near=10**6)]
               for m in (fast, slow)]
        assert got[0] == got[1] and all(len(ids) == n for ids, n in zip(got[0], (2, 1, 1, 3), strict=True))
        assert state(fast) == state(slow)
    finally:
        fast.close()
        slow.close()

    calls = []

    class Counting(KVCacheManager):
        def alloc(self, n: int, *, near: int | None = None) -> list[int] | None:
            calls.append(n)
            return super().alloc(n, near=near)
    with small("fp-sub", pages=4, cls=Counting, env={**DETERMINISTIC, "KVCACHED_FASTPATH": "1"}) as m:
        assert m._fast is not None and "alloc" not in m.__dict__
        assert len(m.alloc(3)) == 3 and calls == [3]


@needs_build
def test_the_c_publish_writes_every_counter_as_python_does() -> None:
    """manager._publish is the C publish once attached: every counter the Python publish writes, the same bytes."""
    m = small("fp-publish", env={**DETERMINISTIC, "KVCACHED_FASTPATH": "1"})
    try:
        held = m.alloc(BPP + 2)
        assert held is not None
        m.mark_cached(held[:3])

        def python_publish() -> None:
            raise AssertionError("the Python publish ran")

        with m._lock:
            for i, name in enumerate(("alloc_count", "free_count", "alloc_blocks", "free_blocks", "evicted_blocks",
                                      "applied_revision", "trim_ack_seq", "trim_bytes", "trimmed_total",
                                      "idle_returned", "requested_limit")):
                setattr(m, name, 1000 + 7 * i)
            m.limit_status, m.limit_pages = L.LIMIT_CONFLICT, 3
            for closing in (True, False):
                m._closed = closing
                m._dirty.update(range(3))
                m._publish_python = python_publish  # type: ignore[method-assign]
                m._publish()
                c_path = state(m)
                c_snap = snapshot(m.name)
                del m._publish_python
                m._dirty.update(range(3))
                m._publish_python()
                assert state(m)[-4:-2] == c_path[-4:-2]  # the counters (but the clock) and the page map
                clockless = {"updated_ns": 0, "heartbeat_ns": 0, "idle_s": None}  # the poller beats meanwhile
                assert snapshot(m.name).to_dict() | clockless == c_snap.to_dict() | clockless
        assert (c_snap.blocks_cached, c_snap.limit_bytes, c_snap.trim_bytes, c_snap.status) == (
            3, 3 * m.bundle_bytes, 1000 + 7 * 7, "live")
    finally:
        m._closed = False
        m.close()


def test_a_counter_the_c_publish_does_not_write_keeps_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastpath, "C_COUNTERS", fastpath.C_COUNTERS - {"trim_bytes"})
    with small("fp-unknown", env={"KVCACHED_FASTPATH": "auto"}) as m:
        assert m._fast is None and "trim_bytes" in m.fastpath_reason
        assert m.alloc(3) is not None


@needs_build
def test_the_binding_names_every_role_c_needs_and_each_exists_on_a_live_allocator() -> None:
    """fastpath.BINDING is the whole contract between fastpath.c and the Python objects: a role C needs and the
    table lacks, or an attribute renamed in Python but not there, fails here rather than inside an alloc."""
    assert MODULE is not None
    assert set(fastpath.BINDING) == set(MODULE.FIELD_ROLES) | set(MODULE.OBJECT_ROLES)
    assert {r for r, (_o, _a, how) in fastpath.BINDING.items() if how == "field"} == set(MODULE.FIELD_ROLES)
    with small("fp-binding", env={"KVCACHED_FASTPATH": "1"}) as m:
        owners = {"manager": m, "pages": m.pages, "cache": m.cache, "segment": m.segment}
        for role, (owner, attr, how) in fastpath.BINDING.items():
            if how == "field":  # read through the owner's __dict__: a property or a slot would not do
                assert attr in vars(owners[owner]), f"{role}: {owner}.{attr} is not an instance attribute"
            else:
                assert hasattr(owners[owner], attr), f"{role}: {owner} has no {attr}"


@needs_build
def test_a_binding_without_a_role_is_refused_by_name() -> None:
    assert MODULE is not None
    with small("fp-unbound", env={"KVCACHED_FASTPATH": "1"}) as m:
        names = fastpath.binding_names()
        for role in ("seq", "release_blocks"):  # a field and an object
            partial = {k: v for k, v in names.items() if k != role}
            with pytest.raises(KeyError, match=f"no attribute for {role} "):
                MODULE.FastPath(m, False, 0.0, m.segment.c_offsets(m.bundle_bytes), partial)
        assert m.alloc(3) is not None  # the allocator's own binding is untouched


@needs_build
@pytest.mark.parametrize("policy", ["first-fit", "affinity"])
def test_first_fit_and_a_waiting_limit_place_in_c_as_python_does(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, slow = pair(policy, env=DETERMINISTIC)
    try:
        def boom(*_args: object, **_kwargs: object) -> None:
            raise AssertionError("the Python placement ran")

        monkeypatch.setattr(fast, "_place", boom)  # every alloc below is placed by the C path
        runs = []
        for n in (5, 11, 3, 8, 2):
            got = [m.alloc(n) for m in (fast, slow)]
            assert got[0] == got[1] and got[0] is not None
            runs.append(got[0])
        for m in (fast, slow):
            m.free(runs[1])
            m.free(runs[3])
        assert state(fast) == state(slow)
        in_use = fast.pages.pages_inuse
        assert [m.set_limit((in_use - 1) * m.bundle_bytes) for m in (fast, slow)] == ["deferred"] * 2
        for n in (3, 1, 4, 30):  # fullest pages first, never a new one; the last cannot fit
            got = [m.alloc(n) for m in (fast, slow)]
            assert got[0] == got[1], n
            assert state(fast) == state(slow), n
        assert got[0] is None and fast.limit_status == L.LIMIT_DEFERRED
    finally:
        fast.close()
        slow.close()
