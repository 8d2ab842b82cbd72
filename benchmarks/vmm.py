"""CUDA backend cost on a real GPU: grow/shrink per page id against a native C floor, and alloc latency.

Run on a GPU machine from the checkout (writes vmm.json and vmm.md under --out):

    PYTHONPATH=. python3 benchmarks/vmm.py --out results/

1. Floor vs backend. ``benchmarks/native/vmm_floor.c`` is compiled here as a shared library
   (nvcc, else cc with CUDA's headers) and loaded into this process; it grows/shrinks page ids
   with the same driver calls in the same order as :class:`kvcached_core.backends.cuda.CudaBackend`,
   which then does the same work, with its native loop and with cuda-python alone. All three
   take turns on every chunk of page ids (rotating who goes first), sharing one context, so
   drift cancels. Both layouts (``layer``, ``page``), chunks of 1 page id (the refill thread's
   steady state in the layer layout) and 4 (its batch in the page layout, and a refill after a burst). Reported: median microseconds per page id
   and the ratio to the floor.
2. Alloc latency while the pool grows: a real KVCacheManager(backend="cuda") starts empty and an
   engine-like loop allocates 1-16 blocks every ``interval`` (sleeping in between, as an engine
   waits on the GPU) while the refill thread maps in the background; p50/p99/max of ``alloc``,
   and how many allocs missed the pool (mapped synchronously). Then free latency, for the record.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcached_core.backends import Geometry  # noqa: E402
from kvcached_core.backends.cuda import CudaBackend  # noqa: E402
from kvcached_core.backends.cuda_native import load as load_native  # noqa: E402

MiB = 1 << 20
OPS = ("grow_cold", "shrink_keep", "grow_warm", "shrink_release")
MISS_US = 200.0  # an alloc slower than this mapped on its own thread (pool miss)


# -- native floor, loaded into this process -----------------------------------------------------------
def build_floor(workdir: Path) -> ctypes.CDLL | None:
    """Compile the native floor as a shared library (nvcc, else cc with CUDA's headers) and load it."""
    src = ROOT / "benchmarks" / "native" / "vmm_floor.c"
    lib = workdir / "libvmm_floor.so"
    nvcc = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)
    homes = [Path(nvcc).resolve().parents[1]] if nvcc else []
    homes += [Path(p) for p in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda") if p]
    libdirs = [f"-L{h}/{sub}" for h in homes for sub in ("lib64/stubs", "targets/x86_64-linux/lib/stubs", "lib64")]
    libdirs += ["-L/usr/local/nvidia/lib64", "-L/usr/lib/x86_64-linux-gnu"]
    attempts = []
    for cuda_lib in ("-lcuda", "-l:libcuda.so.1"):
        if nvcc:
            attempts.append([nvcc, "-O2", "-Xcompiler", "-fPIC", "-shared", "-o", str(lib), str(src), *libdirs, cuda_lib])
        attempts += [["cc", "-O2", "-fPIC", "-shared", f"-I{h}/include", "-o", str(lib), str(src), *libdirs, cuda_lib]
                     for h in homes]
    for cmd in attempts:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            print("built native floor:", " ".join(cmd[:2]), flush=True)
            floor = ctypes.CDLL(str(lib))
            floor.floor_setup.restype = ctypes.c_int
            floor.floor_setup.argtypes = [ctypes.c_int] + [ctypes.c_size_t] * 5
            floor.floor_op.restype = ctypes.c_double
            floor.floor_op.argtypes = [ctypes.c_int]
            floor.floor_chunk.restype = ctypes.c_double
            floor.floor_chunk.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
            floor.floor_teardown.restype = None
            return floor
        last = done.stderr.strip().splitlines()[-1:] if done.stderr else []
        print("native floor build failed:", " ".join(cmd[:2]), *last, flush=True)
    return None


NATIVE_OPS = ("grow_cold", "shrink_keep", "grow_warm", "shrink_release", "grow_naive", "shrink_naive")


# -- the backend, same sequence ----------------------------------------------------------------------
class BackendSide:
    """The backend doing the floor's sequence chunk by chunk: grow from cuMemCreate, shrink into the
    pool, grow from the pool, shrink releasing (synchronous unmapping: the floor's driver work)."""

    def __init__(self, layout: str, args: argparse.Namespace, native: str) -> None:
        geometry = Geometry(args.page_mb * MiB, args.pages, args.layers, args.buffers)
        self.backend = CudaBackend(geometry, 0, layout=layout, pool_pages=0, async_unmap=False, native=native)
        if native == "on":
            assert self.backend._native is not None, self.backend.native_reason
        self.pages = args.pages

    def prepare(self, op: int) -> None:
        """Pool policy per op: 0 grow_cold (empty pool), 1 shrink_keep (pool takes all), 2 grow_warm,
        3 shrink_release (pool takes none)."""
        if op == 0:
            self.backend.pool_pages = 0
            self.backend.trim_pool(0)
        elif op == 1:
            self.backend.pool_pages = self.pages
        elif op == 3:
            self.backend.pool_pages = 0

    def chunk(self, op: int, first: int, n: int) -> float:
        ids = list(range(first, first + n))
        t0 = time.perf_counter_ns()
        if op in (0, 2):
            got = self.backend.map_pages(ids)
            elapsed = (time.perf_counter_ns() - t0) / 1000
            assert got == ids, "device ran out of memory during the benchmark"
            return elapsed
        self.backend.unmap_pages(ids)
        return (time.perf_counter_ns() - t0) / 1000


def compare(floor: ctypes.CDLL | None, args: argparse.Namespace, native_ok: bool) -> list[dict]:
    """Per layout and batch: the C floor, the backend with its native loop, the backend on cuda-python
    alone. They take turns on every chunk of page ids (the order rotates chunk by chunk), so the
    machine's drift hits all three alike; each round covers all page ids."""
    rows = []
    variants = (("backend", "on"), ("bindings", "off")) if native_ok else (("bindings", "off"),)
    for layout in args.layouts.split(","):
        for batch in (1, 4):
            sides = {name: BackendSide(layout, args, mode) for name, mode in variants}
            totals: dict[str, dict[str, list[float]]] = {name: {op: [] for op in NATIVE_OPS} for name in
                                                          ("native", "native_py", *sides)}
            if floor is not None:
                assert floor.floor_setup(int(layout == "layer"), args.layers, args.buffers, args.page_mb, args.pages,
                                         batch) == 0
            order = (["native"] if floor is not None else []) + list(sides)
            chunks = [(first, min(batch, args.pages - first)) for first in range(0, args.pages, batch)]
            try:
                for r in range(args.rounds + 1):  # round 0 warms up
                    for op in range(4):
                        for side in sides.values():
                            side.prepare(op)
                        spent = dict.fromkeys([*order, "native_py"], 0.0)
                        for i, (first, n) in enumerate(chunks):
                            k = (i + r) % len(order)
                            for name in order[k:] + order[:k]:
                                if name == "native":  # timed inside C, and around the call from Python
                                    t0 = time.perf_counter_ns()
                                    spent[name] += floor.floor_chunk(op, first, n)  # type: ignore[union-attr]
                                    spent["native_py"] += (time.perf_counter_ns() - t0) / 1000
                                else:
                                    spent[name] += sides[name].chunk(op, first, n)
                        if r:
                            for name, us in spent.items():
                                if name in order or floor is not None:
                                    totals[name][NATIVE_OPS[op]].append(us / args.pages)
                        if args.settle_ms:
                            time.sleep(args.settle_ms / 1000)  # let the driver finish releases before the next op
                    if floor is not None and r:
                        for op in (4, 5):
                            totals["native"][NATIVE_OPS[op]].append(floor.floor_op(op))
            finally:
                for side in sides.values():
                    side.backend.close()
                if floor is not None:
                    floor.floor_teardown()
            for op in NATIVE_OPS:
                row: dict = {"layout": layout, "batch": batch, "op": op}
                n_ = statistics.median(totals["native"][op]) if totals["native"][op] else None
                row["native_us"] = n_
                row["native_samples"] = [round(x, 1) for x in totals["native"][op]]
                py = totals["native_py"][op]
                n_py = statistics.median(py) if py else None
                row["native_py_us"] = n_py
                floor_rounds = totals["native"][op]
                # The driver has slow spells that last a few rounds (128 MiB creates after much churn:
                # 50 -> 150-400 µs for every side), so a side is compared with the floor round by round:
                # the ratio is the median of per-round ratios. slow_rounds counts the floor's rounds at
                # over twice its best.
                row["slow_rounds"] = sum(1 for x in floor_rounds if x > 2 * min(floor_rounds)) if floor_rounds else None
                for side in ("backend", "bindings"):
                    xs = totals.get(side, {}).get(op, [])
                    v = statistics.median(xs) if xs else None
                    row[f"{side}_us"] = v
                    row[f"{side}_ratio"] = paired(xs, floor_rounds)
                    row[f"{side}_ratio_py"] = paired(xs, py)
                    row[f"{side}_ratio_of_medians"] = round(v / n_, 3) if n_ and v else None
                    row[f"{side}_samples"] = [round(x, 1) for x in xs]
                rows.append(row)
                print(f"{layout:5s} batch {batch} {op:15s} floor {fmt(n_)} us  backend {fmt(row['backend_us'])} us "
                      f"({row['backend_ratio']})  cuda-python only {fmt(row['bindings_us'])} us "
                      f"({row['bindings_ratio']})", flush=True)
    return rows


def paired(xs: list[float], floor: list[float]) -> float | None:
    """Median of per-round ratios side / floor (both timed in the same round), or None."""
    if not xs or len(xs) != len(floor):
        return None
    pairs = [x / f for x, f in zip(xs, floor, strict=True) if f > 0]
    return round(statistics.median(pairs), 3) if pairs else None


def fmt(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:8.1f}"


# -- alloc latency while the pool grows --------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Pacer:
    """Time between allocs. ``gpu``: an engine waiting for its forward pass (a spinning GPU kernel,
    then torch.cuda.synchronize, which spins with the GIL released); ``sleep``: time.sleep, where
    the thread's core idles and wakes cold."""

    def __init__(self) -> None:
        self.torch = None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.init()
                torch.cuda._sleep(1000)
                torch.cuda.synchronize()
                cycles = 20_000_000
                t0 = time.perf_counter()
                torch.cuda._sleep(cycles)
                torch.cuda.synchronize()
                self.cycles_per_us = cycles / ((time.perf_counter() - t0) * 1e6)
                self.torch = torch
        except Exception as exc:  # noqa: BLE001
            print("no GPU pacing:", exc, flush=True)

    def wait(self, mode: str, seconds: float) -> None:
        if mode == "gpu" and self.torch is not None:
            self.torch.cuda._sleep(int(seconds * 1e6 * self.cycles_per_us))
            self.torch.cuda.synchronize()
        else:
            time.sleep(seconds)


def alloc_latency(label: str, layout: str, pacing: str, interval_s: float, args: argparse.Namespace, pacer: Pacer,
                  *, grow: bool = True, churn: bool = False, gc_freeze: bool = True, async_unmap: bool = True,
                  fastpath: bool = True, pin: bool = False, seed: int = 7) -> dict:
    from kvcached_core import KVCacheManager

    os.environ["KVCACHED_CUDA_LAYOUT"] = layout
    os.environ["KVCACHED_CUDA_ASYNC_UNMAP"] = "1" if async_unmap else "0"
    os.environ["KVCACHED_FASTPATH"] = "auto" if fastpath else "0"
    bpp = args.page_mb * MiB // args.block_kib // 1024
    mgr = KVCacheManager(f"bench-{label}", num_blocks=bpp * (args.grow_pages + 64), block_bytes=args.block_kib * 1024,
                         num_layers=args.layers, num_kv_buffers=args.buffers, page_size=args.page_mb * MiB,
                         backend="cuda")
    fast_on = mgr._fast is not None
    allowed = os.sched_getaffinity(0)
    if pin:  # this thread only, after the manager started its threads (they keep every CPU)
        os.sched_setaffinity(0, {max(allowed)})
    rng = random.Random(seed)
    sizes = [16, 32, 64] if churn else [1, 1, 2, 2, 4, 8, 16]  # decode-heavy, some prefill chunks
    lat: list[float] = []
    free_lat: list[float] = []
    held: list[list[int]] = []
    try:
        if not grow or churn:
            assert mgr.try_to_reserve(bpp * (args.grow_pages if not grow else args.grow_pages // 2))
        first = time.perf_counter_ns()
        held.append(mgr.alloc(1))
        first_us = (time.perf_counter_ns() - first) / 1000
        gc.collect()
        if gc_freeze:
            gc.freeze()  # as serving engines do after start-up
        created0 = mgr.backend.created
        t_start = time.perf_counter()
        steps = 0
        def more() -> bool:
            if churn:
                return steps < args.churn_steps
            if not grow:  # every page mapped beforehand: fill most of them
                return mgr.pages.pages_inuse < args.grow_pages - 8 and len(lat) < 20000
            return mgr.pages.mapped_pages < args.grow_pages and len(lat) < 20000

        while more():
            steps += 1
            n = rng.choice(sizes)
            t0 = time.perf_counter_ns()
            ids = mgr.alloc(n)
            lat.append((time.perf_counter_ns() - t0) / 1000)
            if ids is None:
                raise RuntimeError("alloc returned None during the latency benchmark")
            held.append(ids)
            if churn and len(held) > args.churn_held:
                victim = held.pop(0)
                t0 = time.perf_counter_ns()
                mgr.free(victim)
                free_lat.append((time.perf_counter_ns() - t0) / 1000)
            pacer.wait(pacing, interval_s)
        run_s = time.perf_counter() - t_start
        mapped_pages = mgr.pages.mapped_pages
        created = mgr.backend.created - created0
        revived = mgr.backend.revived
        if not churn:
            rng.shuffle(held)
            for ids in held:
                t0 = time.perf_counter_ns()
                mgr.free(ids)
                free_lat.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        if gc_freeze:
            gc.unfreeze()
        if pin:
            os.sched_setaffinity(0, allowed)
        mgr.close()
    row = {
        "label": label, "layout": layout, "pacing": pacing, "interval_us": interval_s * 1e6, "grow": grow,
        "churn": churn, "gc_frozen": gc_freeze, "async_unmap": async_unmap, "allocs": len(lat),
        "seconds": round(run_s, 3), "mapped_pages_end": mapped_pages, "handles_created": created, "pages_revived": revived,
        "page_ids_per_s": round(mapped_pages / run_s, 1) if grow and not churn else None,
        "first_alloc_us": round(first_us, 1),
        "alloc_p50_us": round(pct(lat, 0.50), 2), "alloc_p99_us": round(pct(lat, 0.99), 2),
        "alloc_p999_us": round(pct(lat, 0.999), 2), "alloc_max_us": round(max(lat), 1),
        "misses_over_200us": sum(1 for x in lat if x > MISS_US),
        "alloc_path": "C" if fast_on else "Python", "pinned": pin, "alloc_over_20us": sum(1 for x in lat if x > 20.0),
        "free_p50_us": round(pct(free_lat, 0.50), 2), "free_p99_us": round(pct(free_lat, 0.99), 2),
        "free_max_us": round(max(free_lat), 1),
    }
    print(json.dumps(row), flush=True)
    return row


ALLOC_RUNS = (  # label, layout, pacing, interval us, options
    ("grow-layer-gpu-1000", "layer", "gpu", 1000, {}),
    ("grow-layer-gpu-1000-python", "layer", "gpu", 1000, {"fastpath": False}),
    ("grow-page-gpu-1000", "page", "gpu", 1000, {}),
    ("grow-page-gpu-1000-python", "page", "gpu", 1000, {"fastpath": False}),
    ("grow-layer-gpu-250", "layer", "gpu", 250, {}),
    ("grow-page-gpu-250", "page", "gpu", 250, {}),
    ("nogrow-layer-gpu-1000", "layer", "gpu", 1000, {"grow": False}),
    ("nogrow-layer-gpu-1000-python", "layer", "gpu", 1000, {"grow": False, "fastpath": False}),
    ("grow-layer-gpu-1000-pinned", "layer", "gpu", 1000, {"pin": True}),
    ("grow-page-gpu-1000-pinned", "page", "gpu", 1000, {"pin": True}),
    ("nogrow-layer-gpu-1000-pinned", "layer", "gpu", 1000, {"grow": False, "pin": True}),
    ("grow-layer-sleep-1000", "layer", "sleep", 1000, {}),
    ("grow-layer-gpu-1000-gc", "layer", "gpu", 1000, {"gc_freeze": False}),
    ("churn-layer-gpu-500", "layer", "gpu", 500, {"churn": True}),
    ("churn-layer-gpu-500-syncunmap", "layer", "gpu", 500, {"churn": True, "async_unmap": False}),
    ("churn-page-gpu-500", "page", "gpu", 500, {"churn": True}),
)


# -- report -----------------------------------------------------------------------------------------
def environment() -> dict:
    env: dict = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
                 "host": platform.node()}
    try:
        import cuda.bindings

        env["cuda_bindings"] = cuda.bindings.__version__
    except Exception:  # noqa: BLE001
        env["cuda_bindings"] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        env["gpu"] = name.decode() if isinstance(name, bytes) else name
        drv = pynvml.nvmlSystemGetDriverVersion()
        env["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        env["gpu_memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception as exc:  # noqa: BLE001
        env["nvml_error"] = str(exc)
    return env


def binding_overhead_us(calls: int = 20000) -> float:
    """Median cost of one trivial cuda-python driver call (cuCtxGetCurrent): the wrapper's own price."""
    from cuda.bindings import driver as d

    d.cuInit(0)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            d.cuCtxGetCurrent()
        samples.append((time.perf_counter_ns() - t0) / calls / 1000)
    return round(statistics.median(samples), 3)


def markdown(report: dict) -> str:
    env, cfg = report["environment"], report["config"]
    lines = [
        f"# CUDA VMM backend on {env.get('gpu', '?')} ({env['date']})",
        "",
        f"Driver {env.get('driver', '?')}, cuda-bindings {env.get('cuda_bindings')} (one trivial binding call: "
        f"{env.get('binding_call_us')} µs), Python {env['python']}. "
        f"Model shape: {cfg['layers']} layers x {cfg['buffers']} KV buffers, {cfg['page_mb']} MiB pages "
        f"(one page id = {cfg['layers'] * cfg['buffers'] * cfg['page_mb']} MiB), {cfg['pages']} page ids per trial, "
        f"{cfg['rounds']} rounds; in one process the C floor and the backend take turns on every "
        "chunk of page ids, the floor timed inside C. Times are medians over the rounds; a ratio is the median of "
        "the per-round ratios (both sides timed in the same round), which the driver's slow spells cannot skew. "
        f"Pause after every op: {cfg.get('settle_ms', 0)} ms. "
        "`benchmarks/vmm.py` made this file.",
        "",
        "## Grow and shrink per page id: the backend vs a native C floor doing the same calls in the same order",
        "",
        f"Backend = `CudaBackend` with its native loop (`KVCACHED_CUDA_NATIVE=auto`, the default: "
        f"{env.get('native_helper', '?')}); cuda-python only = `KVCACHED_CUDA_NATIVE=0`. The floor is timed "
        "twice: inside C (driver work only) and around its ctypes call from Python (the boundary the backend "
        "is measured at, which adds the call and the timer).",
        "",
        "| layout | batch | op | C floor µs (timed in C) | same, timed around the call | backend µs | backend / floor "
        "| backend / floor timed around the call | cuda-python only µs | cuda-python / floor | floor's slow rounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.get("compare", []):
        def cell(key: str, r: dict = r) -> str:
            v = r.get(key)
            return "n/a" if v is None else (f"{v:.1f}" if isinstance(v, float) and key.endswith("_us") else str(v))

        lines.append(f"| {r['layout']} | {r['batch']} | {r['op']} | {cell('native_us')} | {cell('native_py_us')} | "
                     f"{cell('backend_us')} | {cell('backend_ratio')} | {cell('backend_ratio_py')} | "
                     f"{cell('bindings_us')} | {cell('bindings_ratio')} | {cell('slow_rounds')} |")
    lines += [
        "",
        "`grow_cold`: every handle from cuMemCreate; `grow_warm`: handles from the pool (after a shrink that kept "
        "them); `shrink_keep`: unmap into the pool; `shrink_release`: unmap and cuMemRelease; `grow_naive` / "
        "`shrink_naive` (native only): one create/map/set-access (unmap/release) call per handle. "
        "Floor's slow rounds: rounds in which the floor took over twice its best round.",
        "",
        "## alloc and free latency (the refill thread maps, the unmapper thread unmaps, in the background)",
        "",
        "`grow`: the model starts empty and grows to the page count while the engine-like loop allocates 1-16 blocks "
        "per step; `nogrow`: the same with every page mapped beforehand; `churn`: 200 requests of 16-64 blocks held "
        "FIFO, one alloc and one free per step, so pages empty, get unmapped and come back. Pacing `gpu`: a spinning "
        "GPU kernel then torch.cuda.synchronize between steps (an engine waiting on its forward pass); `sleep`: "
        "time.sleep. `gc`: the run without gc.freeze(). `pinned`: the engine-like thread is bound to one CPU "
        "(os.sched_setaffinity) after the allocator started its threads, so the OS cannot move it while it waits. Alloc path: `C` is the compiled alloc path "
        "(`KVCACHED_FASTPATH=auto`, the default), `Python` the same run with `KVCACHED_FASTPATH=0`. Misses: allocs over 200 µs (mapped on the caller's thread).",
        "",
        "| run | repeat | alloc path | allocs | alloc p50 µs | p99 | p99.9 | max | allocs > 20 µs | misses "
        "| free p50 / p99 / max | page ids/s | handles created | pages revived |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.get("alloc", []):
        lines.append(
            f"| {r['label']} | {r.get('repeat', 1)} | {r.get('alloc_path', '?')} | {r['allocs']} | {r['alloc_p50_us']} | "
            f"{r['alloc_p99_us']} | {r['alloc_p999_us']} | {r['alloc_max_us']} | {r.get('alloc_over_20us', '')} | "
            f"{r['misses_over_200us']} | {r['free_p50_us']} / {r['free_p99_us']} / {r['free_max_us']} | "
            f"{r['page_ids_per_s'] or ''} | {r['handles_created']} | {r.get('pages_revived', '')} |")
    by_label: dict[str, list[dict]] = {}
    for r in report.get("alloc", []):
        by_label.setdefault(r["label"], []).append(r)
    if any(len(rs) > 1 for rs in by_label.values()):
        lines += ["", "Across the repeats (the runs above, in the order they ran):", "",
                  "| run | repeats | alloc p50 median | alloc p99 median | p99 best / worst |", "|---|---|---|---|---|"]
        for label, rs in by_label.items():
            p99s = sorted(r["alloc_p99_us"] for r in rs)
            lines.append(f"| {label} | {len(rs)} | {statistics.median(r['alloc_p50_us'] for r in rs):.2f} | "
                         f"{statistics.median(p99s):.2f} | {p99s[0]} / {p99s[-1]} |")
    lines.append("")
    return "\n".join(lines)


def save(report: dict, out: Path) -> None:
    (out / "vmm.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "vmm.md").write_text(markdown(report))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--buffers", type=int, default=2)
    ap.add_argument("--page-mb", type=int, default=2)
    ap.add_argument("--pages", type=int, default=64, help="page ids per grow/shrink trial")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block-kib", type=int, default=32, help="block bytes per layer per buffer (KiB)")
    ap.add_argument("--grow-pages", type=int, default=160, help="page ids the alloc benchmark grows to")
    ap.add_argument("--churn-steps", type=int, default=1500, help="alloc+free steps in the churn runs")
    ap.add_argument("--churn-held", type=int, default=200, help="requests held during churn (FIFO)")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--skip-alloc", action="store_true", help="only the grow/shrink comparison")
    ap.add_argument("--layouts", default="layer,page", help="layouts the comparison covers")
    ap.add_argument("--settle-ms", type=float, default=0.0, help="pause after every op of the comparison")
    ap.add_argument("--repeat", type=int, default=1, help="run the alloc-latency list this many times, in turn")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"environment": environment(), "config": {k: v for k, v in vars(args).items() if k != "out"}}
    report["config"]["out"] = str(args.out)
    report["environment"]["binding_call_us"] = binding_overhead_us()
    print(json.dumps(report["environment"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("KVCACHED_SHM_DIR", tmp)
        floor = None if args.no_native else build_floor(Path(tmp))
        report["native_floor_built"] = floor is not None
        helper, why = load_native()
        report["environment"]["native_helper"] = f"installed at {helper.__file__}" if helper else f"unavailable: {why}"
        report["compare"] = [] if args.skip_compare else compare(floor, args, helper is not None)
        save(report, args.out)  # keep what we have if the next part fails
        report["alloc"] = []
        pacer = Pacer()
        report["environment"]["gpu_pacing"] = pacer.torch is not None
        for repeat in range(1, 0 if args.skip_alloc else args.repeat + 1):
            for label, layout, pacing, us, options in ALLOC_RUNS:
                row = alloc_latency(label, layout, pacing, us / 1e6, args, pacer, **options)
                row["repeat"] = repeat
                report["alloc"].append(row)
                save(report, args.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
