"""Probe: ways to move compaction's blocks on a CUDA device, against the device's own ``copy_`` bandwidth.

The shape of benchmarks/compact_copy.py (a Llama-8B-shaped cache: 64 ranges of 48 pages of 2 MiB, 32 KiB
blocks, 576 blocks moved from the sparse pages into the holes of the others), in one plain device allocation
laid out as the layer layout lays out its ranges. Each way's result is checked byte for byte.

    python3 -m benchmarks.probes.batched_copy     # on a GPU machine; prints one JSON line per way
"""

from __future__ import annotations

import json
import random
import statistics

import torch
from cuda.bindings import driver as cu

from benchmarks.compact_copy import _timed

MiB = 1 << 20
RANGES, PAGES, PAGE, BLOCK, KEEP = 64, 48, 2 * MiB, 32 * 1024, 16
BPP = PAGE // BLOCK


def check(err: object) -> None:
    code = err[0] if isinstance(err, tuple) else err
    if code != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {code}")


def moves() -> list[tuple[int, int]]:
    rng = random.Random(7)
    kept = {p: sorted(rng.sample(range(BPP), KEEP)) for p in range(PAGES)}
    sources = [p * BPP + s for p in range(12, PAGES) for s in kept[p]]
    holes = [p * BPP + s for p in range(12) for s in range(BPP) if s not in kept[p]]
    return list(zip(sources, holes, strict=True))


def timed(fn, reps: int = 20) -> list[float]:
    return _timed(fn, torch, reps)


def reference() -> list[float]:
    """Seconds of ``copy_`` of a contiguous 2 GiB buffer (the device's own copy bandwidth)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return timed(lambda: b.copy_(a))


def main() -> None:
    range_bytes = PAGES * PAGE
    buf = torch.empty(RANGES * range_bytes, dtype=torch.uint8, device="cuda")
    base = buf.data_ptr()
    rows = buf.view(RANGES, PAGES, BPP, BLOCK).view(torch.int64)
    mv = moves()
    moved = len(mv) * RANGES * BLOCK
    stream = torch.cuda.current_stream().cuda_stream

    def fill() -> None:
        torch.manual_seed(0)
        buf.view(torch.int64).random_()

    def verify(name: str) -> None:
        src = torch.tensor([s for s, _ in mv], device="cuda")
        dst = torch.tensor([d for _, d in mv], device="cuda")
        flat = rows.view(RANGES, PAGES * BPP, -1)
        ok = bool((flat[:, dst] == flat[:, src]).all())
        print(json.dumps({"way": name, "correct": ok}), flush=True)

    results = {}

    # the reference: copy_ of a contiguous 2 GiB buffer
    results["copy_"] = (2 << 30) / statistics.median(reference()) / 1e9

    # today's device_copy: one gather + one scatter (int64 words)
    index = torch.tensor(mv, dtype=torch.long, device="cuda")
    src, dst = index[:, 0], index[:, 1]

    def gather_scatter() -> None:
        rows[:, dst // BPP, dst % BPP] = rows[:, src // BPP, src % BPP]

    fill()
    results["gather_scatter"] = moved / statistics.median(timed(gather_scatter)) / 1e9
    verify("gather_scatter")

    # one 2D copy a block: height RANGES, pitch range_bytes
    def copy2d() -> None:
        for s, d in mv:
            p = cu.CUDA_MEMCPY2D()
            p.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice = base + s * BLOCK
            p.dstDevice = base + d * BLOCK
            p.srcPitch = p.dstPitch = range_bytes
            p.WidthInBytes = BLOCK
            p.Height = RANGES
            check(cu.cuMemcpy2DAsync(p, stream))

    fill()
    try:
        results["memcpy2d_per_block"] = moved / statistics.median(timed(copy2d, reps=10)) / 1e9
        verify("memcpy2d_per_block")
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        print(json.dumps({"way": "memcpy2d_per_block", "error": repr(exc)}), flush=True)

    # one batched call: every (range, block) as its own copy
    n = len(mv) * RANGES
    srcs = [base + r * range_bytes + s * BLOCK for r in range(RANGES) for s, _ in mv]
    dsts = [base + r * range_bytes + d * BLOCK for r in range(RANGES) for _, d in mv]
    sizes = [BLOCK] * n
    attr = cu.CUmemcpyAttributes()
    attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = 0
    attr.srcLocHint = loc
    attr.dstLocHint = loc
    attr.flags = 0

    cdsts = [cu.CUdeviceptr(v) for v in dsts]
    csrcs = [cu.CUdeviceptr(v) for v in srcs]
    side = torch.cuda.Stream()  # the batched copy refuses the legacy default stream
    cstream = cu.CUstream(side.cuda_stream)

    def batch() -> None:
        check(cu.cuMemcpyBatchAsync(cdsts, csrcs, sizes, n, [attr], [0], 1, cstream))

    fill()
    torch.cuda.synchronize()
    try:
        import time

        t0 = time.perf_counter()
        batch()
        torch.cuda.synchronize()
        results["batch_first_call_s"] = time.perf_counter() - t0
        with torch.cuda.stream(side):
            results["memcpy_batch"] = moved / statistics.median(timed(batch, reps=10)) / 1e9
        verify("memcpy_batch")
        t0 = time.perf_counter()
        for _ in range(5):
            batch()
        results["batch_host_s_per_call"] = (time.perf_counter() - t0) / 5
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        print(json.dumps({"way": "memcpy_batch", "error": repr(exc)}), flush=True)

    # the 2D copies through torch's own: one strided copy_ a block (a view [RANGES, BLOCK] each)
    flat = buf.view(RANGES, PAGES * BPP, BLOCK)

    def views() -> None:
        for s, d in mv:
            flat[:, d].copy_(flat[:, s])

    fill()
    results["copy_per_block_view"] = moved / statistics.median(timed(views, reps=10)) / 1e9
    verify("copy_per_block_view")

    # CPU build cost of the batch's lists
    import time

    t0 = time.perf_counter()
    _ = [base + r * range_bytes + s * BLOCK for r in range(RANGES) for s, _ in mv]
    results["list_build_s"] = time.perf_counter() - t0
    results["moved_bytes"] = moved
    results["device"] = torch.cuda.get_device_name()
    results["driver_version"] = cu.cuDriverGetVersion()[1]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}), flush=True)


if __name__ == "__main__":
    main()
