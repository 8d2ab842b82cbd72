"""Compaction's copy on a CUDA device against the device's own copy bandwidth, measured in the same run.

``device_copy`` moves each block in every layer's every KV buffer with one kernel that reads each block once and
writes it once (``kvcached_core.backends.cuda_copy``); timed beside it, in turns: torch's indexed copy (one
gather into a temporary and one scatter out of it, the way before the kernel) and that copy once per layer
and buffer.

A Llama-8B-shaped cache (32 layers, K and V, 16-token bf16 blocks of 32 KiB, 2 MiB pages: 64 blocks a page,
128 MiB a page id) whose pages each keep a quarter of their blocks, cached; compaction moves the blocks of the
sparsest pages into the others. The copy rate counts each block's bytes once (read and written once each), as
the device-to-device reference does (``copy_`` of a contiguous buffer, timed in the same rotation). Also timed: a whole ``compact()`` (plan,
copy, bookkeeping, unmapping).

    python -m benchmarks.compact_copy OUTDIR   # on a GPU machine: writes OUTDIR/compact-copy.json and .md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

REQUIRES = "gpu"
MiB = 1 << 20
LAYERS, BLOCK, PAGE, PAGES, KEEP = 32, 32 * 1024, 2 * MiB, 48, 16  # KEEP of 64 blocks stay on each page
REF_BYTES = 2 << 30  # the reference copy_'s buffer


def _timed(fn, torch, reps: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` on the current stream (CUDA events), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1000)
    return out


def _one_layout(layout: str, reps: int, torch) -> list[dict]:
    """The rows of one CUDA layout; the allocator's settings for it hold for this call only."""
    env = {"KVCACHED_CUDA_LAYOUT": layout, "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0",
           "KVCACHED_MAX_CACHED_TOKENS": "-1", "KVCACHED_CUDA_ASYNC_UNMAP": "0"}
    with mock.patch.dict(os.environ, env):
        return _measure_layout(layout, reps, torch)


def _interleaved(ways: dict, torch, reps: int) -> dict[str, list[float]]:
    """Seconds of each way's runs (CUDA events), the ways taking turns in a rotating order, after one warm-up each."""
    for fn in ways.values():
        fn()
    torch.cuda.synchronize()
    out: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            out[name] += _timed(ways[name], torch, 1)
    return out


def _measure_layout(layout: str, reps: int, torch) -> list[dict]:
    from kvcached_core import KVCacheManager
    from kvcached_core.allocator.compact import copy_blocks, gather_scatter, plan
    from kvcached_core.backends.cuda_copy import Mover, fits, mover

    ref_src = torch.empty(REF_BYTES, dtype=torch.uint8, device="cuda")
    ref_dst = torch.empty_like(ref_src)

    bpp = PAGE // BLOCK
    with KVCacheManager(f"compact-bench-{layout}", num_blocks=PAGES * bpp, block_bytes=BLOCK, num_layers=LAYERS,
                        page_size=PAGE, backend="cuda", policy="best-fit") as m:
        ids = m.alloc(PAGES * bpp)
        assert ids is not None
        m.free([b for b in ids if b % bpp >= KEEP])
        m.mark_cached([b for b in ids if b % bpp < KEEP])
        moves = plan(m.pages, m.cache)
        for _, dst in moves:  # the destinations, as compact() takes them before the copy
            m.pages.take_block(dst)
        ranges = LAYERS * 2
        copied = len(moves) * BLOCK * ranges
        raw = m.backend.all_blocks(BLOCK)
        kernel = mover(raw.device.index or 0)
        if not isinstance(kernel, Mover) or not fits(raw, moves):
            raise RuntimeError(f"the copy kernel is not usable here: {kernel}")
        rows = raw.view(torch.int64)
        index = torch.tensor(moves, dtype=torch.long, device=rows.device)
        sp, ss, dp, ds = index[:, 0] // bpp, index[:, 0] % bpp, index[:, 1] // bpp, index[:, 1] % bpp

        def per_range() -> None:
            for r in range(ranges):
                view = rows[r]
                view[dp, ds] = view[sp, ss]
        times = _interleaved({"copy_": lambda: ref_dst.copy_(ref_src),
                              "kernel": lambda: kernel.move(raw, moves),
                              "gather_scatter": lambda: gather_scatter(raw, moves),
                              "per_range": per_range}, torch, reps)
        m.free([d for _, d in moves])
        mapped = m.backend.mapped_bytes()
        m.set_compact_handler(lambda mv: copy_blocks(m.backend, BLOCK, mv))
        t0 = time.perf_counter()
        result = m.compact()
        whole = time.perf_counter() - t0
        assert len(result.moves) == len(moves) and mapped - m.backend.mapped_bytes() == result.bytes_returned
    ref = statistics.median(times["copy_"])
    ref_rates = sorted(REF_BYTES / t / 1e9 for t in times["copy_"])
    rows_out = [{"name": f"device copy bandwidth ({layout} layout's run): copy_ of a contiguous 2 GiB buffer",
                 "value": round(REF_BYTES / ref / 1e9, 1), "unit": "GB/s",
                 "note": f"median of {reps} interleaved with the ways below (runs {ref_rates[0]:.0f}-"
                         f"{ref_rates[-1]:.0f}); bytes copied per second (each read once, written once)",
                 "gbps": REF_BYTES / ref / 1e9, "runs_ms": [round(t * 1e3, 4) for t in times["copy_"]]}]
    note = f"{len(moves)} blocks x {ranges} ranges = {copied / MiB:.0f} MiB, median of {reps} interleaved"
    labels = {"kernel": "device_copy's kernel (each block read once, written once)",
              "gather_scatter": "one gather + one scatter (torch's indexed copy)",
              "per_range": "one gather + scatter per layer and buffer"}
    for way, label in labels.items():
        runs = times[way]
        mid = statistics.median(runs)
        rates = sorted(copied / t / 1e9 for t in runs)
        share = copied / mid / 1e9 / rows_out[0]["gbps"]
        rows_out.append({
            "name": f"compaction copy, {layout} layout: {label}", "value": round(mid * 1e3, 3), "unit": "ms",
            "note": f"{note}; {copied / mid / 1e9:.0f} GB/s (runs {rates[0]:.0f}-{rates[-1]:.0f}), {share:.0%} of "
                    "this run's copy_",
            "gbps": copied / mid / 1e9, "of_copy": share, "bytes": copied,
            "runs_ms": [round(t * 1e3, 4) for t in runs]})
    rows_out.append({"name": f"compaction, {layout} layout: whole compact() (plan, copy, bookkeeping, unmap)",
                     "value": round(whole * 1e3, 2), "unit": "ms",
                     "note": f"{len(result.moves)} blocks moved, {result.bytes_returned / MiB:.0f} MiB returned",
                     "returned": result.bytes_returned})
    return rows_out


def run(quick: bool) -> list[dict]:
    import torch

    reps = 5 if quick else 20
    rows: list[dict] = []
    for layout in ("layer", "page"):
        rows += _one_layout(layout, reps, torch)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    import torch

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rows = run(quick=False)
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    (out / "compact-copy.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    lines = [f"{info['date']}, {info['gpu']}, torch {info['torch']}", "", "| figure | value | unit | note |",
             "|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['value']} | {r['unit']} | {r['note']} |" for r in rows]
    (out / "compact-copy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
