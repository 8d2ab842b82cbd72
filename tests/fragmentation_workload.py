"""The fragmentation workload: a small serving-engine model that drives a real KVCacheManager.

A closed loop of ``concurrency`` requests (host backend, small pages so it runs fast); each
prompt is an optional hot shared prefix (Zipf popularity) plus a unique suffix, prefilled in one
``alloc``; decode adds one block at a time (passing the request's last block as the ``near``
hint), and requests end at different moments. Like vLLM, the engine keeps a prefix index of full
blocks: a new request reuses the cached blocks of its prefix (a hit), a finished request's full
blocks are ``mark_cached`` (its partial last block is freed), and the allocator evicts to stay
within the cache budget. Some requests are follow-ups of a recent conversation and hit its
blocks. After the traffic drains the model goes idle; its segment is read as ``kvctl frag``
does (pages pinned, packed floor). Then a short burst of new traffic measures what the idle
phase cost in prefix-cache hits.

Counts are deterministic for a workload's seed: the reserve pool's background refill is off
(``KVCACHED_MIN_RESERVED_PAGES=0``; a pool miss maps on the caller's thread) so page ids do not
depend on thread timing. ``tests/test_fragmentation.py`` checks the default policy's target on it;
``benchmarks/fragmentation.py`` runs it over more workloads and times the allocs.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import os
import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvcached_core.allocator.compact import host_copy
from kvcached_core.allocator.manager import KVCacheManager
from kvcached_core.segment.frag import fragmentation
from kvcached_core.segment.reader import snapshot
from kvcached_core.settings import settings

KiB = 1024


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """These environment variables for the duration; the previous values afterwards."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class Workload:
    """Traffic shape. Token counts are medians of log-normal distributions."""

    label: str = "base"
    seed: int = 1
    concurrency: int = 96
    requests: int = 1200
    block_tokens: int = 16
    page_size: int = 256 * KiB
    block_bytes: int = 16 * KiB
    cache_tokens: int = 16000
    prefixes: int = 48  # distinct hot shared prefixes
    zipf: float = 1.0
    shared: float = 0.6  # share of requests that start with a hot prefix
    prefix_tokens: tuple[int, int] = (64, 768)
    suffix_tokens: int = 200
    decode_tokens: int = 160
    sigma: float = 0.9
    followup: float = 0.15  # share of requests continuing a recent conversation
    after_idle: int = 192  # requests served after the idle phase
    arrival_gap: float = 0.0  # > 0: open loop, mean tokens between arrivals (idle moments happen)


@dataclass
class Result:
    workload: str
    policy: str
    idle_pinned: int
    idle_floor: int
    idle_cached: int
    idle_mapped_bytes: int
    idle_returned_bytes: int
    hits: int
    hits_after_idle: int
    lookups: int
    peak_pages: int
    alloc_us_median: float
    alloc_us_p99: float
    allocs: int = 0
    compaction: bool = False  # the engine registered a compact handler
    cache_budget: int = 0  # blocks the cache budget allows
    compactions: int = 0
    blocks_moved: int = 0
    copied_bytes: int = 0
    copy_s: float = 0.0  # time in the engine's copies (memmove of the KV bytes)
    compact_s: float = 0.0  # time in compaction (plan, copy, bookkeeping, unmapping) while idle

    @property
    def cache_kept(self) -> float:
        """Cached blocks held once idle, as a share of the cache budget."""
        return self.idle_cached / self.cache_budget if self.cache_budget else 0.0

    @property
    def ratio(self) -> float:
        return self.idle_pinned / self.idle_floor if self.idle_floor else 1.0


@dataclass
class Request:
    rid: int
    prompt: int
    decode: int
    base: tuple  # hashes of leading full blocks shared with earlier traffic
    table: list[int] = field(default_factory=list)
    registered: int = 0  # full blocks already in the prefix index

    @property
    def length(self) -> int:
        return self.prompt + self.decode

    def block_hash(self, j: int) -> object:
        return self.base[j] if j < len(self.base) else (self.rid, j)


class Engine:
    """The engine side: prefix index, block tables, reference counts, the allocator calls."""

    def __init__(self, manager: KVCacheManager, wl: Workload) -> None:
        self.m = manager
        self.wl = wl
        self.rng = random.Random(wl.seed)
        self.bt = wl.block_tokens
        self.index: dict[object, int] = {}
        self.hash_of: dict[int, object] = {}
        self.refs: dict[int, int] = {}
        self.hits = self.lookups = 0
        self.alloc_ns: list[int] = []
        self.peak_pages = 0
        self.recent: deque[tuple] = deque(maxlen=64)  # full-block hashes of recent conversations
        self.next_rid = 0
        self.copy_ns = 0
        self.compact_ns = 0  # mark_cached calls in which idle packing compacted, and explicit compactions
        weights = [1 / (i + 1) ** wl.zipf for i in range(wl.prefixes)]
        total = sum(weights)
        self.prefix_cdf = list(_accumulate(w / total for w in weights))
        lo, hi = wl.prefix_tokens
        self.prefix_len = [self.rng.randint(lo, hi) for _ in range(wl.prefixes)]

    # -- traffic -----------------------------------------------------------------------------
    def _lognormal(self, median: int, cap: int) -> int:
        return max(1, min(cap, int(self.rng.lognormvariate(math.log(median), self.wl.sigma))))

    def new_request(self) -> Request:
        rid, wl, bt = self.next_rid, self.wl, self.bt
        self.next_rid += 1
        base: tuple = ()
        start = 0
        if self.recent and self.rng.random() < wl.followup:
            base = self.rng.choice(self.recent)
            start = len(base) * bt
        elif self.rng.random() < wl.shared:
            pid = _bisect(self.prefix_cdf, self.rng.random())
            plen = self.prefix_len[pid]
            base = tuple(("p", pid, j) for j in range(plen // bt))
            start = plen
        prompt = start + self._lognormal(wl.suffix_tokens, 4096)
        return Request(rid, prompt, self._lognormal(wl.decode_tokens, 4096), base)

    def _alloc(self, n: int, near: int | None = None) -> list[int]:
        t0 = time.perf_counter_ns()
        ids = self.m.alloc(n, near=near)
        self.alloc_ns.append(time.perf_counter_ns() - t0)
        if ids is None:
            raise RuntimeError("the benchmark sized the model too small: alloc returned None")
        for block in ids:
            self.refs[block] = 1
        inuse = self.m.pages.pages_inuse
        if inuse > self.peak_pages:
            self.peak_pages = inuse
        return ids

    def _register(self, req: Request, upto: int) -> None:
        """Full blocks ``< upto`` of ``req`` enter the prefix index (first writer wins)."""
        for j in range(req.registered, upto):
            h = req.block_hash(j)
            if h not in self.index:
                block = req.table[j]
                self.index[h] = block
                self.hash_of[block] = h
        req.registered = max(req.registered, upto)

    def admit(self, req: Request) -> None:
        bt, full = self.bt, req.prompt // self.bt
        revive: list[int] = []
        hit = 0
        while hit < full:
            block = self.index.get(req.block_hash(hit))
            if block is None:
                break
            if self.refs.get(block, 0) == 0:
                revive.append(block)
            self.refs[block] = self.refs.get(block, 0) + 1
            req.table.append(block)
            hit += 1
        if revive:
            self.m.reuse(revive)
        self.hits += hit
        self.lookups += full
        req.registered = hit
        need = -(-req.prompt // bt) - hit
        if need:
            req.table += self._alloc(need)
        self._register(req, full)

    def decode_block(self, req: Request, j: int) -> None:
        """Token ``j * bt`` starts block ``j``: block ``j - 1`` is now full."""
        req.table += self._alloc(1, req.table[-1] if req.table else None)
        self._register(req, j)

    def finish(self, req: Request) -> None:
        full = req.length // self.bt
        self._register(req, full)
        cache: list[int] = []
        drop: list[int] = []
        for block in req.table:
            left = self.refs[block] - 1
            if left:
                self.refs[block] = left
                continue
            del self.refs[block]
            (cache if self.hash_of.get(block) is not None and self.index.get(self.hash_of[block]) == block
             else drop).append(block)
        if drop:
            for block in drop:
                self._forget(block)
            self.m.free(drop)
        if cache:
            t0, before = time.perf_counter_ns(), self.m.compaction.compactions
            evicted = self.m.mark_cached(cache)
            if self.m.compaction.compactions != before:
                self.compact_ns += time.perf_counter_ns() - t0
            for block in evicted:
                self._forget(block)
        self.recent.append(tuple(req.block_hash(j) for j in range(full)))

    def compact_handler(self, moves: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The engine's side of compaction: copy the blocks' KV bytes, then move the prefix index with them."""
        t0 = time.perf_counter_ns()
        done = host_copy(self.m.backend, self.m.block_bytes, moves)
        self.copy_ns += time.perf_counter_ns() - t0
        for src, dst in done:
            self._forget(dst)  # a slot evicted in the same mark_cached call: not in its evicted list
            h = self.hash_of.pop(src)
            self.hash_of[dst] = h
            if self.index.get(h) == src:
                self.index[h] = dst
        return done

    def check_index(self) -> None:
        """Every prefix-index entry names a block recorded under that same hash (a stale entry would serve
        another prefix's K/V on a hit)."""
        stale = [h for h, block in self.index.items() if self.hash_of.get(block) != h]
        assert not stale, f"{len(stale)} prefix-index entries name a block that holds another prefix"

    def _forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.index.get(h) == block:
            del self.index[h]

    # -- the run -----------------------------------------------------------------------------
    def serve(self, count: int, concurrency: int) -> None:
        """Closed loop: ``concurrency`` requests in flight until ``count`` were admitted, then drain."""
        bt = self.bt
        events: list[tuple[int, int, int, Request]] = []  # (time, seq, next block or -1 = finish, req)
        seq = 0
        admitted = 0

        def start(now: int) -> None:
            nonlocal seq, admitted
            req = self.new_request()
            admitted += 1
            self.admit(req)
            _schedule(now, req)

        def _schedule(t0: int, req: Request) -> None:
            nonlocal seq
            j = -(-req.prompt // bt)  # the first block decode has to add
            while True:
                k = j * bt - req.prompt + 1  # decode token that starts block j
                if k > req.decode:
                    break
                heapq.heappush(events, (t0 + k, seq, j, req))
                seq += 1
                j += 1
            heapq.heappush(events, (t0 + req.decode, seq, -1, req))
            seq += 1

        gap = self.wl.arrival_gap
        if gap > 0:  # open loop: Poisson arrivals, nothing else in flight between some of them
            t = 0.0
            for _ in range(count):
                t += self.rng.expovariate(1 / gap)
                heapq.heappush(events, (int(t), seq, -2, None))  # type: ignore[arg-type]
                seq += 1
        else:
            for _ in range(min(concurrency, count)):
                start(self.rng.randrange(2 * self.wl.decode_tokens))
        while events:
            now, _seq, what, req = heapq.heappop(events)
            if what >= 0:
                self.decode_block(req, what)
            elif what == -2:
                start(now)
            else:
                self.finish(req)
                if admitted < count and gap <= 0:
                    start(now)


def _accumulate(values):
    total = 0.0
    for v in values:
        total += v
        yield total


def _bisect(cdf: list[float], x: float) -> int:
    lo, hi = 0, len(cdf) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cdf[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def run_workload(wl: Workload, policy: str, *, compaction: bool = False) -> Result:
    """Serve ``wl`` on a fresh allocator under ``policy`` (in the KVCACHED_SHM_DIR the caller set); measure the
    idle phase from the segment.

    ``compaction``: the engine registers a compact handler (the policy's idle packing then compacts
    instead of evicting); a policy without idle packing is compacted once idle, as ``kvctl compact`` would.
    """
    env = {"KVCACHED_HOST_CAPACITY": "8GiB", "KVCACHED_MIN_RESERVED_PAGES": "0",
           "KVCACHED_MAX_RESERVED_PAGES": "10", "KVCACHED_IDLE_RETURN_S": "0.05",
           "KVCACHED_MAX_CACHED_TOKENS": str(wl.cache_tokens), "KVCACHED_MAX_CACHED_BLOCKS": ""}
    with _environment(env):
        longest = 3 * 4096 + max(wl.prefix_tokens)
        num_blocks = (wl.concurrency * 2 * longest) // wl.block_tokens + 4 * wl.cache_tokens // wl.block_tokens
        with KVCacheManager(f"frag-{policy}", num_blocks=num_blocks, block_bytes=wl.block_bytes, num_layers=1,
                            page_size=wl.page_size, block_tokens=wl.block_tokens, policy=policy) as m:
            engine = Engine(m, wl)
            if compaction:
                m.set_compact_handler(engine.compact_handler)
            engine.serve(wl.requests, wl.concurrency)
            engine.check_index()
            assert m.pages.blocks_used == m.cached_blocks, "requests still active after the drain"
            if compaction and m.policy.pack_ratio is None:
                t0 = time.perf_counter_ns()
                m.compact()
                engine.compact_ns += time.perf_counter_ns() - t0
            snap = _idle_snapshot(m.name)
            frag = fragmentation(snap)
            hits_before = engine.hits
            engine.serve(wl.after_idle, wl.concurrency)
            engine.check_index()
            ns = sorted(engine.alloc_ns)
            return Result(
                workload=wl.label, policy=policy, idle_pinned=snap.pages_inuse,
                idle_floor=frag.packed_floor_pages, idle_cached=snap.blocks_cached,
                idle_mapped_bytes=snap.mapped_bytes, idle_returned_bytes=snap.idle_returned,
                hits=engine.hits, hits_after_idle=engine.hits - hits_before, lookups=engine.lookups,
                peak_pages=engine.peak_pages, alloc_us_median=ns[len(ns) // 2] / 1e3,
                alloc_us_p99=ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3, allocs=len(ns),
                compaction=compaction, cache_budget=settings().cached_blocks(wl.block_tokens) or 0,
                compactions=snap.compaction.compactions if snap.compaction else 0,
                blocks_moved=snap.compaction.blocks_moved if snap.compaction else 0,
                copied_bytes=snap.compaction.bytes_copied if snap.compaction else 0,
                copy_s=engine.copy_ns / 1e9, compact_s=engine.compact_ns / 1e9,
            )


def _idle_snapshot(name: str, timeout: float = 5.0):
    """The segment once the idle watcher has given back the warm pool (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    snap = snapshot(name)
    while snap.pages_reserved and time.monotonic() < deadline:
        time.sleep(0.01)
        snap = snapshot(name)
    return snap
