"""Two real vLLM engines under one KV budget, prefix caching on (vLLM's default): the idle engine's cached
prefix blocks are reclaimed when the other needs room (kvcached_core/allocator/pressure.py), and the busy
engine's greedy tokens stay those of plain vLLM.

One start of each engine; no timing assertions beyond generous deadlines.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import snapshot
from kvcached_vllm.tiny import prompts

from .conftest import BASELINE_TOKENS, LONG, SHORT
from .harness import base_env, settled, start_server

BUDGET = 64 << 20  # 128 blocks of the tiny model (512 KiB each): two engines' worth of 64-block static shares
IDLE_PROMPTS = prompts(10, length=900, seed=7)  # the idle engine's traffic: 7 full blocks each stay cached


def test_an_idle_engines_prefix_cache_goes_to_a_busy_engine(model_dir: Path, workdir: Path,
                                                           baseline: list[list[int]]) -> None:
    shm = workdir / "shm-pressure"
    shm.mkdir()
    env = base_env(shm, enabled=True, KVCACHED_HOST_CAPACITY=f"{BUDGET}B", KVCACHED_IDLE_RETURN_S="-1")
    idle = start_server(model_dir, env, workdir / "serve-idle.log", name="idle")
    try:
        for prompt in IDLE_PROMPTS:  # one after another: each leaves its full blocks in the prefix cache
            idle.complete(prompt, 4)
        # once its refill thread (nice +10: late on a loaded host) has mapped the reserve back after the last request
        held = settled("idle", shm)
        assert held.blocks_cached >= 32 and held.mapped_bytes >= BUDGET * 3 // 4, (  # most of the budget
            f"the idle engine holds {held.blocks_cached} cached blocks in {held.mapped_bytes} bytes")
        busy = start_server(model_dir, env, workdir / "serve-busy.log", name="busy")
        try:
            wanted = LONG[:8]
            with ThreadPoolExecutor(len(wanted)) as pool:  # at once: more than the budget leaves the busy engine
                tokens = list(pool.map(lambda p: busy.complete(p, BASELINE_TOKENS), wanted))
            first = len(SHORT)
            assert tokens == baseline[first:first + len(wanted)], "greedy tokens differ from plain vLLM's"
            after = snapshot("idle", directory=shm)
            gave = after.pressure
            took = snapshot("busy", directory=shm).pressure
            assert gave is not None and took is not None
            # given_* describe the last reclaim only (a later one may take reserved pages alone): that cached pages
            # went at all is read from the cached blocks the idle engine no longer holds (nothing else evicts them:
            # idle return is off)
            assert gave.gave_total > 0 and after.blocks_cached < held.blocks_cached, (
                f"the idle engine gave no cached blocks ({held.blocks_cached} -> {after.blocks_cached}): {gave}")
            assert took.took_total >= gave.given_bytes > 0 and took.asked_count >= 1
            assert gave.given_to == L.model_id(snapshot("busy", directory=shm).pid, "busy")
            # the idle engine still serves, with what prefix cache it kept
            assert len(idle.complete(IDLE_PROMPTS[-1], 4)) == 4
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the two never hold more than the budget together
                both = [snapshot(n, directory=shm).mapped_bytes for n in ("idle", "busy")]
                assert sum(both) <= BUDGET, both
                time.sleep(0.5)
                if not snapshot("busy", directory=shm).pressure.wanted_bytes:  # type: ignore[union-attr]
                    break
        finally:
            busy.stop()
    finally:
        idle.stop()
