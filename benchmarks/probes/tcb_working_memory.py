"""Working memory of transformers' continuous batching, static against elastic on one trace: what the read window saves.

A Llama-3.2-1B-shaped model (``--shape 3b``: 3B-shaped) with random bf16 weights built in place (no download) runs
one trace through ``generate_batch`` (sdpa) in four configurations, one after another in this process:

- ``static``: plain transformers with a cache of one share (``num_blocks``);
- ``elastic-before``: kvcached with the whole budget (``--shares`` shares) as address space and the read window off,
  so transformers sizes its attention buffers by that address space (the path before the window; the probe turns
  the window off through ``kvcached_transformers.cb.paged.window_applies``);
- ``elastic``: the same with the read window (the plugin's path);
- ``elastic-capped``: the same with ``max_read_tokens`` of one share's tokens (``--cap-tokens``).

Working memory is torch's peak of allocated bytes during the run less what was allocated before it (the weights)
less the KV cache torch allocated (plain transformers' cache tensor; kvcached maps its KV outside torch's allocator).
Beside it, the largest attention inputs seen by the attention function: the mask's buffer and the keys and values
read (their bytes), and the most cached tokens one batch read. Two traces: ``fits`` (every request's KV fits one
share at once) and ``saturated`` (they need the whole budget; a static engine runs them in waves). One JSON line per
run, then a table of each configuration's working memory over static's.

On a GPU (torch and a transformers the plugin serves, ``kvcached_transformers.cb.seams.SUPPORTED``; exit code 2
with one line otherwise, or without a GPU)::

    PYTHONPATH=.:plugins python benchmarks/probes/tcb_working_memory.py

On CPU (``--device cpu``, a tiny model): the attention inputs only, torch keeps no peak there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp(prefix="kvc-probe-"))

PAGE_TOKENS = 256
CONFIGS = ("static", "elastic-before", "elastic", "elastic-capped")
SHAPES = {  # Llama-3.2 shapes: layers, hidden, intermediate, heads, kv heads, head_dim
    "1b": (16, 2048, 8192, 32, 8, 64),
    "3b": (28, 3072, 8192, 24, 8, 128),
    "tiny": (2, 256, 512, 8, 4, 32),
}


@dataclass
class Seen:
    """The largest attention inputs of a run (bytes of the storage each is a view of)."""

    mask_bytes: int = 0
    kv_read_bytes: int = 0  # the keys and values handed to attention (every request's past and new tokens)
    most_read_tokens: int = 0  # cached tokens one batch read


@contextmanager
def watched(implementation: str) -> Iterator[Seen]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS[implementation]
    seen = Seen()

    def spy(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        if attention_mask is not None:
            seen.mask_bytes = max(seen.mask_bytes, attention_mask.untyped_storage().nbytes())
        # The keys attended over: read before this call (transformers 5.2x) or inside it (5.19: its read indices).
        keys = max(key.shape[-2], *(index.numel() for index in kwargs.get("read_index") or ()))
        seen.kv_read_bytes = max(seen.kv_read_bytes, 2 * keys * key.shape[1] * key.shape[-1] * key.element_size())
        seen.most_read_tokens = max(seen.most_read_tokens, keys - query.shape[-2])
        return original(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = spy
    try:
        yield seen
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = original


@contextmanager
def torch_kv_bytes() -> Iterator[list[int]]:
    """The bytes of every cache tensor torch allocates while inside (plain transformers'; kvcached's is a view)."""
    from transformers.generation.continuous_batching import cache

    original = cache.PagedAttentionCache.__init__
    found = [0]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.cache_tensor.device.type != "meta":
            found[0] += self.cache_tensor.numel() * self.cache_tensor.element_size()

    cache.PagedAttentionCache.__init__ = init  # type: ignore[method-assign]
    try:
        yield found
    finally:
        cache.PagedAttentionCache.__init__ = original  # type: ignore[method-assign]


@contextmanager
def window_off() -> Iterator[None]:
    from kvcached_transformers.cb import paged

    original = paged.window_applies
    paged.window_applies = lambda cb_config: False
    try:
        yield
    finally:
        paged.window_applies = original


def build(shape: str, device: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter, heads, kv_heads, head_dim = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=32000, max_position_embeddings=16384)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def kv_bytes_per_token(model: Any) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * next(model.parameters()).element_size()


def run(model: Any, prompts: list[list[int]], config: str, share_blocks: int, shares: int, args: Any) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcached_transformers import cb

    cuda = args.device == "cuda"
    gen = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    elastic = config != "static"
    cb_config = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=None if elastic else share_blocks,
                                         max_batch_tokens=args.max_batch_tokens,
                                         max_requests_per_batch=args.max_requests, use_cuda_graph=False)
    handle = None
    if elastic:
        cap = (args.cap_tokens or share_blocks * PAGE_TOKENS) if config == "elastic-capped" else None
        handle = cb.install(model, name=f"probe-{config}", num_blocks=shares * share_blocks, max_read_tokens=cap)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    try:
        with watched("sdpa") as seen, torch_kv_bytes() as kv, window_off() if config == "elastic-before" else \
                _nothing():
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        registered = handle.working_memory if handle is not None else None
    finally:
        if handle is not None:
            handle.close()
    failed = [r for r in out.values() if r.error is not None]
    if len(out) != len(prompts) or failed:
        raise SystemExit(f"tcb_working_memory: {config}: {len(out) - len(failed)} of {len(prompts)} requests answered")
    tokens = sum(len(r.generated_tokens) for r in out.values())
    row: dict[str, Any] = {"config": config, "kv_in_torch_MiB": round(kv[0] / 2**20, 1),
                           "working_MiB": round((peak - base - kv[0]) / 2**20, 1) if cuda else None,
                           "tok_s": round(tokens / wall, 1), "wall_s": round(wall, 2)}
    row.update(mask_MiB=round(seen.mask_bytes / 2**20, 2), kv_read_MiB=round(seen.kv_read_bytes / 2**20, 2),
               most_read_tokens=seen.most_read_tokens)
    if registered is not None:
        row["registered_peak_MiB"] = round(registered[0] / 2**20, 1)
    row["tokens"] = [list(r.generated_tokens) for r in out.values()]
    return row


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default=None, choices=tuple(SHAPES), help="default: 1b on cuda, tiny on cpu")
    parser.add_argument("--share-mib", type=int, default=None, help="one static share of KV (default 1024; cpu 4)")
    parser.add_argument("--shares", type=int, default=3, help="the elastic engine's budget, in shares")
    parser.add_argument("--cap-tokens", type=int, default=None,
                        help="elastic-capped's max_read_tokens (default: one share's tokens)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens per request (default 1536; cpu 48)")
    parser.add_argument("--new", type=int, default=32, help="new tokens per request")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--traces", default="fits,saturated")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    shape = args.shape or ("tiny" if cpu else "1b")
    args.share_mib = args.share_mib or (4 if cpu else 1024)
    args.prompt = args.prompt or (48 if cpu else 1536)
    if cpu:
        args.max_batch_tokens = min(args.max_batch_tokens, 256)

    import torch
    import transformers

    if not cpu and not torch.cuda.is_available():
        print("tcb_working_memory: no CUDA device (use --device cpu for the attention inputs alone)", file=sys.stderr)
        return 2
    from kvcached_transformers.cb.seams import UnsupportedTransformers, check

    try:
        check()
    except UnsupportedTransformers as exc:
        print(f"tcb_working_memory: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    model = build(shape, args.device)
    per_token = kv_bytes_per_token(model)
    share_blocks = max(1, (args.share_mib << 20) // (per_token * PAGE_TOKENS))
    request_blocks = -(-(args.prompt + args.new) // PAGE_TOKENS)  # a request holds whole blocks
    counts = {"fits": max(1, int(0.8 * share_blocks) // request_blocks),
              "saturated": max(1, int(0.9 * args.shares * share_blocks) // request_blocks)}
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(0) if not cpu else "cpu", "shape": shape,
                      "kv_bytes_per_token": per_token, "share_blocks": share_blocks, "shares": args.shares,
                      "max_batch_tokens": args.max_batch_tokens, "requests": counts}), flush=True)
    generator = torch.Generator().manual_seed(1)
    table: list[dict[str, Any]] = []
    for trace in args.traces.split(","):
        prompts = [torch.randint(4, 32000 if not cpu else 512, (args.prompt,), generator=generator).tolist()
                   for _ in range(counts[trace])]
        rows: dict[str, dict[str, Any]] = {}
        for config in CONFIGS:
            row = rows[config] = run(model, prompts, config, share_blocks, args.shares, args)
            if config in ("elastic", "elastic-capped"):  # greedy tokens against the path before the window
                row["same_tokens_as_before"] = row["tokens"] == rows["elastic-before"]["tokens"]
            print(json.dumps({"trace": trace, **{k: v for k, v in row.items() if k != "tokens"}}), flush=True)
        table.append({"trace": trace, "rows": rows})
    for figure in ("mask_MiB", "kv_read_MiB") if cpu else ("working_MiB", "mask_MiB", "kv_read_MiB"):
        print(f"\n{figure} over static's (same trace):")
        for entry in table:
            rows = entry["rows"]
            base = rows["static"][figure] or 1
            ratios = "  ".join(f"{c} {rows[c][figure]} ({rows[c][figure] / base:.2f}x)" for c in CONFIGS[1:])
            print(f"  {entry['trace']:<10} static {rows['static'][figure]}  {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
