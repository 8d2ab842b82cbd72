"""Where does an alloc right after a GPU wait spend its time? (GPU machine; runs on the host backend too.)

Loads the C alloc path built with ``-DKVC_PROFILE`` (TSC stamps between its stages) into a growing
model, waits 1 ms (GPU work, or a sleep without a GPU) before every alloc, and prints per stage
the p50, the p99 and the mean share among the slowest 1 % of allocs, for the first alloc after the
wait and for a second one straight after. ``wrapper`` is everything around the placement and the
publish: the call, the lock, the checks and the refill request, and the probe's own clock reads.
``PYTHONPATH=. python3 benchmarks/probes/alloc_stages.py [--backend host]``; results: benchmarks/results/vmm-h200.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from types import ModuleType

os.environ.setdefault("KVCACHED_SHM_DIR", tempfile.mkdtemp())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vmm

from kvcached_core import KVCacheManager, fastpath
from kvcached_core.allocator.placement import Affinity

SIZES = [1, 1, 2, 2, 4, 8, 16]
STAGES = ("wrapper", "load_state", "placement", "store_state", "ids_list", "counters", "publish_setup",
          "page_map", "counter_writes", "checksum")
STAMP_PAIRS = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9))


def build_profiled() -> ModuleType:
    """fastpath.c compiled with ``-DKVC_PROFILE`` into a temporary directory and imported (the probe's own
    build: the installed extension has no stamps)."""
    source = os.path.join(os.path.dirname(fastpath.__file__), "fastpath.c")
    out = os.path.join(tempfile.mkdtemp(), "_fastpath" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    cc = shlex.split(os.environ.get("CC") or "cc")
    done = subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-DKVC_PROFILE", f"-I{sysconfig.get_paths()['include']}",
                           "-o", out, source], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cannot build the profiled C path: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    spec = importlib.util.spec_from_file_location("_fastpath", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profiled(m: KVCacheManager):
    module = build_profiled()
    policy = m.policy
    fast = module.FastPath(m, int(type(policy) is Affinity), float(getattr(policy, "slack", 0.0)),
                           m.segment.c_offsets(m.bundle_bytes), fastpath.binding_names())
    return module, fast


def tsc_per_ns(m: KVCacheManager, module) -> float:
    t_a = time.perf_counter_ns()
    ids_a = m.alloc(1)
    s_a = module.stamps()[0]
    time.sleep(0.2)
    t_b = time.perf_counter_ns()
    ids_b = m.alloc(1)
    s_b = module.stamps()[0]
    m.free(ids_a)
    m.free(ids_b)
    return (s_b - s_a) / (t_b - t_a)


def breakdown(total_ns: int, stamps: tuple[int, ...], per_ns: float) -> list[float]:
    parts = [(stamps[b] - stamps[a]) / per_ns / 1e3 for a, b in STAMP_PAIRS]
    return [total_ns / 1e3 - sum(parts), *parts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--layout", default="layer")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    os.environ["KVCACHED_CUDA_LAYOUT"] = args.layout
    pacer = vmm.Pacer()
    mode = "gpu" if pacer.torch is not None else "sleep"
    m = KVCacheManager("stages", num_blocks=64 * 400, block_bytes=32 << 10, num_layers=32, page_size=2 << 20,
                       backend=args.backend)
    module, m._fast = profiled(m)
    m.alloc = m._fast.manager_alloc  # type: ignore[method-assign]
    per_ns = tsc_per_ns(m, module)
    rng = random.Random(11)
    rows: dict[str, list[list[float]]] = {"first": [], "second": []}
    held = []
    gc.collect()
    gc.freeze()
    try:
        for _ in range(args.steps):
            if m.pages.mapped_pages >= 300:
                break
            pacer.wait(mode, 0.001)
            for which in ("first", "second"):
                t0 = time.perf_counter_ns()
                held.append(m.alloc(rng.choice(SIZES)))
                t1 = time.perf_counter_ns()
                rows[which].append([(t1 - t0) / 1e3, *breakdown(t1 - t0, module.stamps(), per_ns)])
    finally:
        gc.unfreeze()
        for ids in held:
            if ids:
                m.free(ids)
        m.close()
    print(f"backend {args.backend}, layout {args.layout}, pacing {mode}, TSC {per_ns:.3f}/ns")
    for which, data in rows.items():
        data.sort()
        top = data[int(0.99 * len(data)):]
        print(f"\n{which} alloc after the wait: n={len(data)} total p50 {vmm.pct([r[0] for r in data], .5):.2f} "
              f"p99 {vmm.pct([r[0] for r in data], .99):.2f} µs")
        print("| stage | p50 µs | p99 µs | mean in the slowest 1 % |\n|---|---|---|---|")
        for i, stage in enumerate(STAGES, start=1):
            col = [r[i] for r in data]
            print(f"| {stage} | {vmm.pct(col, .5):.2f} | {vmm.pct(col, .99):.2f} | {sum(r[i] for r in top) / len(top):.2f} |")


if __name__ == "__main__":
    main()
