"""Does the refill thread's polling beside an engine slow the engine? (transformers' continuous batching, CPU or GPU.)

One request stream runs through ``generate_batch`` on kvcached, alternately with the refill thread as engines now
have it (``ENGINE_LINGER_S``: it sleeps until an alloc wakes it) and as they had it before (the manager's default
linger: after an alloc that leaves the warm pool short it looks every ``REFILL_POLL_S`` for ``REFILL_LINGER_S``,
taking the GIL from the engine's scheduling thread at each look). ABBA order, ``--pairs`` pairs after one warm-up of
each; per run the wall time, the refill thread's looks and the allocs; per pair the ratio polling/sleeping.

Run from the checkout: ``PYTHONPATH=.:plugins .venv/bin/python benchmarks/probes/refill_linger.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp(prefix="kvc-probe-"))
os.environ.setdefault("KVCACHED_IDLE_RETURN_S", "-1")

PAGE_TOKENS = 256


def one_run(model: Any, prompts: list[list[int]], new_tokens: int, blocks: int, linger: float) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcached_transformers.cb as cb
    from kvcached_core.allocator import refill

    looks = [0]
    real_step = refill.step

    def counted(m: Any, linger_until: float) -> float | None:
        looks[0] += 1
        return real_step(m, linger_until)

    saved = cb.ENGINE_LINGER_S
    cb.ENGINE_LINGER_S = linger  # read when the install makes its manager
    refill.step = counted
    handle = cb.install(model, name=f"linger-{os.getpid()}")
    try:
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cbc = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=blocks, max_batch_tokens=512,
                                       max_requests_per_batch=16)
        began = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cbc)
        seconds = time.perf_counter() - began
        assert len(out) == len(prompts) and all(r.error is None for r in out.values())
        allocs = handle.manager.alloc_count if handle.manager is not None else 0
    finally:
        handle.close()
        refill.step = real_step
        cb.ENGINE_LINGER_S = saved
    return {"seconds": seconds, "looks": looks[0], "allocs": allocs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()

    import torch

    from kvcached_core.allocator.refill import REFILL_LINGER_S
    from kvcached_core.engines import ENGINE_LINGER_S
    from kvcached_transformers.tiny import random_prompts, tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(seed=3, layers=4, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512)
    if args.device == "cuda":
        model = model.to("cuda")
    prompts = random_prompts(args.requests, seed=11, min_len=200, max_len=700)
    blocks = 4 * args.requests
    variants = {"sleeping": ENGINE_LINGER_S, "polling": REFILL_LINGER_S}
    order = ["sleeping", "polling"]  # warm-up of each, then ABBA
    for i in range(args.pairs):
        order += ["sleeping", "polling"] if i % 2 == 0 else ["polling", "sleeping"]
    runs: list[tuple[str, dict]] = []
    for i, name in enumerate(order):
        r = one_run(model, prompts, args.new_tokens, blocks, variants[name])
        runs.append((name, r))
        kind = "warm-up" if i < 2 else f"pair {(i - 2) // 2 + 1}"
        print(f"run {i + 1} ({kind}) {name}: {r['seconds']:.3f} s, refill looks {r['looks']}, allocs {r['allocs']}",
              flush=True)
    counted = runs[2:]
    ratios = []
    for k in range(0, len(counted), 2):
        pair = dict(counted[k:k + 2])
        ratios.append(pair["polling"]["seconds"] / pair["sleeping"]["seconds"])
    print(f"wall time polling/sleeping per pair: {', '.join(f'{x:.3f}' for x in ratios)}; median "
          f"{statistics.median(ratios):.3f}x (range {min(ratios):.3f}-{max(ratios):.3f}x); {args.device}, "
          f"{args.requests} requests x {args.new_tokens} new tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
