"""Host time per scheduling pass that transformers' continuous batching spends in kvcached's code, elastic vs static.

One request stream runs through ``generate_batch`` on a tiny random Llama, alternately on plain transformers (static:
a cache of ``--share`` blocks) and on kvcached (elastic: ``4 x share`` blocks of address space under a budget of the
static cache's bytes plus ``--others`` idle models' pages, each of them a segment the budget's scan reads). Each piece
is timed by wrapping its method at its class (inclusive of what it calls; the wrappers' own cost is in every figure
alike) and divided by the scheduling passes of the run; the table gives the median over ``--repeats`` runs of each.

Run from the checkout: ``PYTHONPATH=.:plugins .venv/bin/python benchmarks/probes/cb_step_overhead.py`` (``--device
cuda`` on a GPU machine: the budget is then ``KVCACHED_DEVICE_BUDGET``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp(prefix="kvc-probe-"))
os.environ.setdefault("KVCACHED_IDLE_RETURN_S", "-1")

PAGE_TOKENS = 256
NEW_TOKENS = 48


def pieces() -> list[tuple[str, Any, str]]:
    """(label, class, method) of every piece timed; a class missing in a configuration counts zero there."""
    from transformers.generation.continuous_batching import cache, continuous_api, scheduler

    from kvcached_core.allocator import admission, publishing
    from kvcached_core.backends import ledger
    from kvcached_transformers.cb import loop, paged, stats

    return [
        ("prepare_next_batch (all)", continuous_api.ContinuousBatchProcessor, "prepare_next_batch"),
        ("  loop wrapper: prepare", loop.LoopControl, "prepare_next_batch"),
        ("  loop wrapper: service", loop.LoopControl, "service"),
        ("  loop wrapper: publish", loop.LoopControl, "_publish"),
        ("schedule_batch (all)", scheduler.FIFOScheduler, "schedule_batch"),
        ("  loop wrapper: schedule", loop.LoopControl, "schedule_batch"),
        ("  begin_pass", paged.KvcachedPagedAttentionCache, "begin_pass"),
        ("  end_pass", paged.KvcachedPagedAttentionCache, "end_pass"),
        ("  schedulable_blocks", admission.Admission, "schedulable_blocks"),
        ("  ledger scan (directory)", ledger.CapacityLedger, "_scan"),
        ("  growth_reserve", paged.KvcachedPagedAttentionCache, "growth_reserve"),
        ("  can_store_request_tokens", cache.PagedAttentionCache, "can_store_request_tokens"),
        ("  can_store (kvcached)", paged.KvcachedPagedAttentionCache, "can_store_request_tokens"),
        ("  compute_free_capacity", cache.PagedAttentionCache, "compute_free_capacity"),
        ("  compute_free_capacity (kvc)", paged.KvcachedPagedAttentionCache, "compute_free_capacity"),
        ("  count_pass (stats)", stats.AdmissionStats, "count_pass"),
        ("sectors taken (alloc)", paged.KvcachedPagedAttentionCache, "_take"),
        ("sectors given back (free)", paged.KvcachedCachePool, "release"),
        ("manager.publish_traffic", publishing.Publishing, "publish_traffic"),
        ("room handler (_room_came)", admission.Admission, "_room_came"),
    ]


class Timers:
    """Inclusive nanoseconds and calls per piece while installed (the loop's thread only: the pieces it runs)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved: list[tuple[Any, str, Any]] = []
        for label, cls, name in pieces():
            original = cls.__dict__.get(name)
            if original is None:
                continue
            saved.append((cls, name, original))
            setattr(cls, name, self._wrap(label, original))
        try:
            yield
        finally:
            for cls, name, original in saved:
                setattr(cls, name, original)

    def _wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        ns, calls, clock = self.ns, self.calls, time.perf_counter_ns
        ns.setdefault(label, 0)
        calls.setdefault(label, 0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[label] += clock() - t0
                calls[label] += 1

        return timed


def run_once(model: Any, prompts: list[list[int]], num_blocks: int, elastic: bool, device: str) -> dict[str, float]:
    """One run of the stream; µs per scheduling pass of each piece, and the run's passes and seconds."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcached_transformers import cb

    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=num_blocks, max_batch_tokens=512,
                                      max_requests_per_batch=8, scheduler_type="fifo")
    timers = Timers()
    handle = cb.install(model, name="probe-elastic") if elastic else None
    try:
        with timers.installed():
            t0 = time.perf_counter()
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)
            wall = time.perf_counter() - t0
    finally:
        if handle is not None:
            handle.close()
    if len(out) != len(prompts):
        raise SystemExit(f"cb_step_overhead: {len(out)} of {len(prompts)} requests answered")
    passes = max(1, timers.calls.get("schedule_batch (all)", 0))
    row = {label: timers.ns[label] / 1000 / passes for label in timers.ns}
    row.update({f"{label} calls": timers.calls[label] / passes for label in timers.calls})
    row["passes"], row["seconds"] = passes, wall
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--share", type=int, default=10, help="the static cache in blocks (elastic: its budget)")
    parser.add_argument("--others", type=int, default=2, help="idle models on the budget (segments its scan reads)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.requests < 1 or args.share < 2 or args.others < 0:
        print("cb_step_overhead: --repeats, --requests, --others must be positive, --share at least 2",
              file=sys.stderr)
        return 2

    import torch

    from kvcached_core import KVCacheManager
    from kvcached_transformers.tiny import random_prompts, tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512,
                       device=args.device)
    block_bytes = 2 * 2 * 4 * 32 * 4 * PAGE_TOKENS  # layers x K,V x kv heads x head dim x fp32 x tokens: 512 KiB
    page = 2 << 20
    budget = (args.share + 2) * block_bytes + args.others * page
    os.environ["KVCACHED_DEVICE_BUDGET" if args.device == "cuda" else "KVCACHED_HOST_CAPACITY"] = f"{budget}B"
    others = []
    for i in range(args.others):  # idle models holding one page each: segments on the budget, as in a fleet
        other = KVCacheManager(f"probe-other{i}", name=f"probe-other{i}", num_blocks=16, block_bytes=page,
                               num_layers=1, num_kv_buffers=1, page_size=page,
                               backend="cuda" if args.device == "cuda" else "host")
        other.alloc(1)
        others.append(other)
    prompts = random_prompts(args.requests, seed=21, min_len=230, max_len=500)
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for r in range(args.repeats):
            for elastic in ((False, True) if r % 2 == 0 else (True, False)):  # ABBA
                rows[elastic].append(run_once(model, prompts, 4 * args.share if elastic else args.share,
                                              elastic, args.device))
    finally:
        for other in others:
            other.close()

    def med(elastic: bool, key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in rows[elastic])

    print(f"# µs per scheduling pass in each piece (inclusive), median of {args.repeats} runs; {args.requests} "
          f"requests, share {args.share} blocks, {args.others} other models on the budget, {args.device}")
    print(f"passes: static {med(False, 'passes'):.0f}, elastic {med(True, 'passes'):.0f}; seconds: static "
          f"{med(False, 'seconds'):.2f}, elastic {med(True, 'seconds'):.2f}")
    print(f"| {'piece':32} | {'static µs':>10} | {'elastic µs':>10} | {'elastic calls':>13} |")
    print(f"|{'-' * 34}|{'-' * 12}:|{'-' * 12}:|{'-' * 15}:|")
    for label, _cls, _name in pieces():
        s, e = med(False, label), med(True, label)
        if s == 0 and e == 0:
            continue
        print(f"| {label:32} | {s:10.1f} | {e:10.1f} | {med(True, label + ' calls'):13.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
