"""Greedy generation for several concurrent prompts with the KV cache on kvcached's elastic allocator.

A small Llama-style model is built from a config with random weights (fixed seed, nothing is
downloaded). Requests of different lengths join a running batch as others leave; each one's K/V
lives in allocator blocks that are taken as it grows and given back the moment it finishes. The
allocator publishes its segment, so in another terminal::

    kvtop                      # the page map grows and empties while this runs
    kvctl show tiny-llama      # or: kvctl watch

Examples::

    python examples/generate.py                      # CPU, host backend
    python examples/generate.py --device cuda        # GPU, CUDA virtual memory backend
    python examples/generate.py --step-delay 0.05 --hold 30   # slow enough to watch, then stay visible
    python examples/generate.py --limit 4MiB         # a tight limit: the clear exhaustion error
    python examples/generate.py --check              # tokens compared with transformers' DynamicCache

Exit status: 0 done, 1 failure (exhausted cache, no GPU, a --check mismatch), 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import torch
except ImportError:
    sys.exit("examples/generate.py needs torch and transformers: pip install '.[transformers]'")

from kvcached_core import format_bytes, parse_size, snapshot
from kvcached_core.engines import KVCacheExhausted
from kvcached_transformers import GreedyEngine, PagedKVCache, cache_arg, random_prompts, tiny_llama

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HOST_PAGE = "512KiB"
MODEL = dict(vocab_size=512, hidden_size=512, heads=8, kv_heads=8, layers=4, intermediate_size=1024)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (host backend) or cuda[:N] (CUDA backend); default cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="model and KV dtype (default float32, which keeps --check exact on a GPU too)")
    p.add_argument("--requests", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once; the rest wait (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="the longest request's budget; others get less, so they end at different times (default 128)")
    p.add_argument("--prompt-len", type=int, default=64, help="the longest prompt (default 64)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts (default 0)")
    p.add_argument("--name", help="segment name kvtop shows (default tiny-llama, or tiny-llama-PID when taken)")
    p.add_argument("--page-size", help=f"page size (default {HOST_PAGE} on the host backend for a finer page map, "
                   "KVCACHED_PAGE_SIZE_MB when set and on a GPU)")
    p.add_argument("--limit", help="cap the model's mapped memory, e.g. 64MiB, before generating")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for blocks before failing (default 0)")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep between steps, to watch it in kvtop")
    p.add_argument("--hold", type=float, default=0.0, metavar="S",
                   help="keep the segment alive S seconds after generating, so kvtop keeps showing it")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: the model is tiny, more threads mostly contend)")
    p.add_argument("--check", action="store_true", help="also generate with DynamicCache and compare tokens")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    args = p.parse_args(argv)
    for name in ("requests", "max_batch", "max_new_tokens", "prompt_len", "block_tokens", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.prompt_len < 2:
        p.error("--prompt-len must be at least 2")
    for name in ("wait", "step_delay", "hold"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} cannot be negative")
    try:
        args.page_size = parse_size(args.page_size) if args.page_size else None
        args.limit = parse_size(args.limit) if args.limit else None
    except ValueError as exc:
        p.error(str(exc))
    return args


def fail(message: str) -> int:
    print(f"generate.py: {message}", file=sys.stderr)
    return 1


def status_line(cache: PagedKVCache) -> str:
    s = snapshot(cache.manager.name)  # what kvtop and kvctl read from the segment
    return (f"blocks {s.blocks_used:4d} · pages in use {s.pages_inuse:2d} · reserved {s.pages_reserved:2d} · "
            f"mapped {format_bytes(s.mapped_bytes)}")


def reference(model: torch.nn.Module, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
    """Each prompt alone through transformers' generate with its own DynamicCache."""
    from transformers import DynamicCache

    outs = []
    for prompt, budget in zip(prompts, budgets, strict=True):
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False,
                             **cache_arg(model, DynamicCache(config=model.config)), pad_token_id=0, eos_token_id=None)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        return fail(f"bad --device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda: torch sees no CUDA GPU here (this torch build: "
                    f"{torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    if device.type not in ("cpu", "cuda"):
        return fail(f"--device must be cpu or cuda, not {args.device!r}")
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    if args.page_size is None and device.type == "cpu" and not os.environ.get("KVCACHED_PAGE_SIZE_MB"):
        args.page_size = parse_size(HOST_PAGE)

    model = tiny_llama(seed=args.seed, device=device, dtype=dtype, **MODEL)
    prompts = random_prompts(args.requests, seed=args.seed, max_len=args.prompt_len, vocab_size=MODEL["vocab_size"])
    budgets = [max(1, args.max_new_tokens * (1 + (i * 7) % args.requests) // args.requests)
               for i in range(args.requests)]
    max_tokens = 4 * sum(len(p) + b for p, b in zip(prompts, budgets, strict=True))
    try:
        cache = PagedKVCache.for_model(model, name=args.name, block_tokens=args.block_tokens, max_tokens=max_tokens,
                                       page_size=args.page_size, wait=args.wait)
    except Exception as exc:  # noqa: BLE001 - one clear line for any setup failure (name taken, no driver, ...)
        return fail(f"cannot start the allocator: {exc}")
    with cache:
        m = cache.manager
        print(f"model tiny-llama ({MODEL['layers']} layers, {MODEL['kv_heads']} KV heads, {dtype}) on {device}; "
              f"segment {m.name!r}, backend {m.backend.name}, block {args.block_tokens} tokens = "
              f"{format_bytes(m.block_bytes * m.num_layers * 2)}, page bundle {format_bytes(m.bundle_bytes)}")
        print(f"watch it: kvtop   |   kvctl show {m.name}", flush=True)
        if args.limit is not None:
            print(f"limit {format_bytes(args.limit)}: {m.set_limit(args.limit)}")
        engine = GreedyEngine(model, cache, max_batch=args.max_batch)
        reqs = [engine.submit(p, b) for p, b in zip(prompts, budgets, strict=True)]
        peak = 0
        started = time.perf_counter()
        try:
            while engine.busy:
                done = engine.step()
                peak = max(peak, m.used_blocks)
                if done and not args.quiet:
                    names = ", ".join(f"#{r.rid} ({len(r.prompt)}+{len(r.output)})" for r in done)
                    print(f"step {engine.steps:4d}  done {names:<28s} {status_line(cache)}", flush=True)
                if args.step_delay:
                    time.sleep(args.step_delay)
        except KVCacheExhausted as exc:
            return fail(str(exc))
        elapsed = time.perf_counter() - started
        tokens = sum(len(r.output) for r in reqs)
        print(f"{len(reqs)} requests, {tokens} new tokens in {engine.steps} steps, {elapsed:.2f}s "
              f"({tokens / elapsed:.0f} tok/s); peak {peak} blocks; now {status_line(cache)}")
        if not args.quiet:
            for r in reqs:
                print(f"  #{r.rid:<3d} prompt {len(r.prompt):3d} tokens -> {r.output[:10]}{' ...' if len(r.output) > 10 else ''}")
        if args.check:
            same = reference(model, prompts, budgets) == [r.output for r in reqs]
            print(f"identical to DynamicCache: {'yes' if same else 'NO'}")
            if not same:
                return fail("tokens differ from transformers' DynamicCache")
        if args.hold:
            with contextlib.suppress(KeyboardInterrupt):  # entered first: Ctrl-C right after the line is caught too
                print(f"holding the segment {args.hold:g}s (Ctrl-C to stop)", flush=True)
                time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    # `kill` (SIGTERM) unwinds like Ctrl-C does, through `with cache:`: the segment goes with the process
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    sys.exit(main())
