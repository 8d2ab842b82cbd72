"""Compaction on a real vLLM engine (plugins/kvcached_vllm/compact.py): the allocator's two-phase compaction, its
copies carried by the scheduler's block copies, ``kvctl compact`` on a busy engine and idle packing on an idle
one. Prefix-cache hits survive it and greedy tokens are the same. One engine for the module (affinity placement:
each request on pages of its own, so requests that run together leave their cached blocks spread).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvcached_core.segment import layout as L
from kvcached_core.segment.pagemap import decoded
from kvcached_core.segment.reader import snapshot
from kvcached_core.segment.snapshot import ModelSnapshot
from kvcached_vllm.tiny import prompts

from .harness import BIN, Busy, Server, base_env, engine_stopped, start_server, wait_for

NAME = "tiny-compact"
BLOCK_TOKENS = 128
TOKENS = 24  # greedy tokens per prompt: long enough that a batch's requests all run before the first ends
PROMPTS = 32


@pytest.fixture(scope="module")
def engine(model_dir: Path, workdir: Path) -> Iterator[tuple[Server, Path]]:
    shm = workdir / "shm-compact"
    shm.mkdir()
    env = base_env(shm, enabled=True, KVCACHED_IDLE_RETURN_S="-1", KVCACHED_POLICY="affinity",
                   KVCACHED_MAX_CACHED_TOKENS="100000")
    # a token budget that schedules a whole batch in one step: its blocks are taken together, full and partial
    # blocks side by side, so the partial ones leave holes between the cached ones when they are freed
    server = start_server(model_dir, env, workdir / "serve-compact.log", name=NAME,
                          args=("--max-num-batched-tokens", "8192"))
    try:
        yield server, shm
    finally:
        server.stop()


def hits(server: Server) -> float:
    for line in server.metrics().splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vLLM exports no prefix-cache hit counter")


def run_together(server: Server, batch: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda p: server.complete(p, TOKENS), batch))


def floor(m: ModelSnapshot) -> int:
    """The pages the model's used blocks need, packed."""
    return -(-m.blocks_used // m.blocks_per_page)


def returnable(m: ModelSnapshot) -> int:
    """The pages a compaction can empty now, counted as the allocator plans them: in-use pages whose used blocks
    are all cached (a running request's blocks and the placeholder never move), sparsest first, while the holes
    left on the other in-use pages hold their blocks. Pages above the floor are not enough: a sparse page that
    also holds the streamed request's blocks stays."""
    assert m.pages is not None, m
    bpp = m.blocks_per_page
    inuse = [(p, used, cached) for p, (mapped, used, cached) in enumerate(decoded(m.pages)) if mapped and used]
    cap = {p: min(bpp, m.num_blocks - p * bpp) for p, _, _ in inuse}
    holes = sum(cap[p] - used for p, used, _ in inuse)
    emptied = 0
    for _, p in sorted((used, p) for p, used, cached in inuse if used == cached):  # sparsest first
        holes -= cap[p]  # its own holes are no destination, and its used blocks fill others'
        if holes < 0:
            break
        emptied += 1
    return emptied


def spread(server: Server, shm: Path, seed: int) -> tuple[list[list[int]], list[list[int]], ModelSnapshot]:
    """Prompts of one full block and a partial one, run together: each page they took is left half cached (the
    full blocks) and half free (the partial blocks, never cached). Requests that reach the engine in different
    steps may refill holes, or share a page with the streamed request's blocks, instead: another batch then,
    until a compaction has a page to return, at most three in all."""
    batch: list[list[int]] = []
    tokens: list[list[int]] = []
    for attempt in range(3):
        more = prompts(PROMPTS, length=BLOCK_TOKENS + 100, seed=seed * 10 + attempt)
        tokens += run_together(server, more)
        batch += more
        m = snapshot(NAME, directory=shm)
        if returnable(m) > 0:
            break
    assert m.blocks_cached >= len(batch), m
    return batch, tokens, m


def compact_requests(m: ModelSnapshot) -> int:
    """The compact requests controllers have made of ``m`` so far (its CONTROL block's sequence word)."""
    with open(m.path, "rb") as segment:
        segment.seek(L.COMPACT_REQ_OFF)
        return L.U64.unpack(segment.read(L.U64.size))[0]


@contextlib.contextmanager
def frozen(server: Server, shm: Path) -> Iterator[ModelSnapshot]:
    """The engine stopped (:func:`engine_stopped`) and its model as it last published it; stopped again, at most
    five times, when the stop cut a publish short."""
    for _ in range(5):
        with engine_stopped(server):
            try:
                m = snapshot(NAME, directory=shm)
            except BlockingIOError:
                continue
            if m.figures_ns:  # the stop cut a publish short: these are its last known figures, not its pages now
                continue
            yield m
            return
    raise AssertionError(f"{NAME}'s engine was stopped inside a publish five times")


def test_kvctl_compact_on_a_busy_engine_packs_its_cache_and_keeps_the_hits(engine: tuple[Server, Path]) -> None:
    """On the old code kvctl compact is refused: the vLLM engine registered no compact handler."""
    server, shm = engine
    ctl = base_env(shm, enabled=False)
    busy = Busy(server, shm, seed=40)
    try:
        for attempt in range(3):
            batch, first, _ = spread(server, shm, seed=41 + 100 * attempt)
            # The engine is stopped from the look at its pages until kvctl's request is in its segment: the busy
            # streams, each taking a block every 128 tokens, filled the holes within kvctl's start in CI (three
            # compactions in a row returned nothing). Continued, it plans the round at its next step.
            with frozen(server, shm) as before:
                if returnable(before) == 0:  # the streams filled the holes since spread() looked: another batch
                    continue
                assert before.compaction is not None and before.compaction.capable
                assert before.compaction.bytes_returned is not None
                assert busy.running()
                asked = compact_requests(before)
                ask = subprocess.Popen([str(BIN / "kvctl"), "compact", NAME, "--json", "--wait", "60"], env=ctl,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                wait_for(lambda m=before, n=asked, p=ask: compact_requests(m) > n or p.poll() is not None)
            out, err = ask.communicate(timeout=120)
            assert ask.returncode == 0, err
            answer = json.loads(out)
            assert answer["status"] == "compacted"
            after = snapshot(NAME, directory=shm)
            assert after.compaction is not None
            # Pages emptied and unmapped, blocks moved since `before`: by this request, or by a round the engine
            # ran just before it (seen in CI trials once, cause not established), after which this one finds
            # nothing left and returns 0 bytes: again then, with another batch. Not the pages in use: the streamed
            # requests keep taking pages meanwhile (a loaded host saw 12 -> 12 after a compaction that returned
            # pages).
            if after.compaction.bytes_returned > before.compaction.bytes_returned:
                break
        else:
            pytest.fail("no batch left a page a compaction could empty, three times")
        assert after.blocks_cached >= before.blocks_cached  # nothing evicted: moved
        assert after.compaction.bytes_returned > before.compaction.bytes_returned, (before, after)
        assert after.compaction.blocks_moved > before.compaction.blocks_moved
        start = hits(server)
        again = [server.complete(p, TOKENS) for p in batch]
        assert again == first
        assert hits(server) - start >= len(batch) * BLOCK_TOKENS  # every prompt's full blocks were hits
    finally:
        busy.stop()
    print(f"kvctl compact: pages {before.pages_inuse} -> {after.pages_inuse} (floor {floor(before)}), "
          f"{after.compaction.blocks_moved} blocks moved, {answer['bytes_copied']} B copied, "
          f"{answer['bytes_returned']} B returned")


def test_an_idle_engine_packs_by_compacting_and_keeps_its_cache(engine: tuple[Server, Path]) -> None:
    """Idle packing moves the cached blocks together instead of evicting the sparse pages (the old code's
    packing drops them: fewer cached blocks, misses on the same prompts)."""
    server, shm = engine
    busy = Busy(server, shm, seed=50)
    try:
        batch, first, during = spread(server, shm, seed=51)
        assert returnable(during) > 0, during
    finally:
        busy.stop()

    def packed() -> ModelSnapshot | None:
        m = snapshot(NAME, directory=shm)
        idle = m.traffic is not None and not m.traffic.running and m.blocks_used - m.blocks_cached == 1
        return m if idle and m.pages_inuse == floor(m) else None

    after = wait_for(packed)  # the harness's 120 s: the engine packs once idle, late on a loaded host
    assert after.blocks_cached >= during.blocks_cached  # kept (the streamed request's own blocks joined)
    start = hits(server)
    assert [server.complete(p, TOKENS) for p in batch] == first
    assert hits(server) - start >= len(batch) * BLOCK_TOKENS
    print(f"idle packing: pages {during.pages_inuse} -> {after.pages_inuse} (floor {floor(after)}), "
          f"cached {during.blocks_cached} -> {after.blocks_cached}")
