"""Tensor-parallel broadcast: what one page id costs to map and unmap on every rank.

The scheduler's :class:`~kvcached_core.tp.BroadcastBackend` sends each map and unmap to the
rank workers over Unix sockets and waits for every answer. We time single-page map and unmap
(the refill thread's steady state) for TP = 1, 2, 4 with both strategies: ``sequential``
(send to a rank, wait, next rank) and ``concurrent`` (send to all, then collect). Backends:

- ``null``: the workers map nothing, so what is left is the broadcast itself;
- ``host``: real memory (madvise) with a tiny geometry (one 4 KiB page per page id) so the
  memory cost does not dominate; the scheduler also claims the host share (flock) per page;
- ``cuda`` (on a GPU machine, ``--backend cuda``): real VMM pages, one GPU per rank; a tiny
  geometry (1 layer x K/V) and a 32-layer one in the layer-separated and page-major layouts.
  Unmapped handles go to the backend's pool, so a map after an unmap is a warm map.

An "in-process" row maps the same page with the backend in the scheduler's own process: the
difference is what the broadcast adds. ``run(quick)`` gives rows for ``python -m benchmarks``;
on a GPU machine::

    PYTHONPATH=. python3 benchmarks/tp.py --backend cuda --worlds 1,2 --out results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcached_core.backends import Backend, Geometry  # noqa: E402
from kvcached_core.tp import STRATEGIES, attach, spawn_workers  # noqa: E402
from kvcached_core.tp.rank_backends import make_rank_backend  # noqa: E402

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Case:
    label: str
    backend: str
    geometry: Geometry
    env: tuple[tuple[str, str], ...] = ()  # e.g. the cuda layout, for the workers and in-process


HOST_CASES = (
    Case("null", "null", Geometry(4 * KiB, 64, 1, 1)),
    Case("host 4 KiB/page", "host", Geometry(4 * KiB, 64, 1, 1)),
)
CUDA_CASES = (
    Case("null", "null", Geometry(2 * MiB, 64, 1, 1)),
    Case("cuda 1 layer K/V", "cuda", Geometry(2 * MiB, 64, 1, 2)),
    Case("cuda 32 layers K/V, layer layout", "cuda", Geometry(2 * MiB, 64, 32, 2), (("KVCACHED_CUDA_LAYOUT", "layer"),)),
    Case("cuda 32 layers K/V, page layout", "cuda", Geometry(2 * MiB, 64, 32, 2), (("KVCACHED_CUDA_LAYOUT", "page"),)),
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_map_unmap(backend: Backend, rounds: int, warmup: int, pages: int) -> tuple[list[float], list[float]]:
    """Microseconds per single-page map and unmap, cycling over ``pages`` page ids."""
    maps: list[float] = []
    unmaps: list[float] = []
    clock = time.perf_counter_ns
    for i in range(warmup + rounds):
        page = [i % pages]
        t0 = clock()
        got = backend.map_pages(page)
        t1 = clock()
        if got != page:
            raise RuntimeError(f"{backend.name}: page {page} was not mapped ({got})")
        backend.unmap_pages(page)
        t2 = clock()
        if i >= warmup:
            maps.append((t1 - t0) / 1000)
            unmaps.append((t2 - t1) / 1000)
    return maps, unmaps


def _summary(case: Case, world: int | None, strategy: str, maps: list[float], unmaps: list[float]) -> dict:
    return {"case": case.label, "backend": case.backend, "world": world, "strategy": strategy,
            "geometry": {"page_size": case.geometry.page_size, "num_layers": case.geometry.num_layers,
                         "num_kv_buffers": case.geometry.num_kv_buffers},
            "rounds": len(maps),
            "map_us_p50": round(statistics.median(maps), 1), "map_us_p99": round(_pct(maps, 0.99), 1),
            "unmap_us_p50": round(statistics.median(unmaps), 1), "unmap_us_p99": round(_pct(unmaps, 0.99), 1)}


class _env:
    """Set environment variables for a block (workers inherit them)."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs, self.old = pairs, {}

    def __enter__(self) -> None:
        for k, v in self.pairs:
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_case(case: Case, worlds: list[int], rounds: int, warmup: int, devices: list[int] | None = None,
                 log=None) -> list[dict]:
    """In-process baseline, then every TP size with both strategies over the same workers."""
    out: list[dict] = []
    with _env(case.env):
        local = make_rank_backend(case.backend, case.geometry, (devices or [0])[0])
        try:
            out.append(_summary(case, None, "in-process", *time_map_unmap(local, rounds, warmup, case.geometry.num_pages)))
        finally:
            local.close()
        if log:
            log(out[-1])
        for world in worlds:
            devs = (devices or list(range(world)))[:world] if case.backend == "cuda" else None
            group = spawn_workers(world, backend=case.backend, devices=devs, label=f"bench{world}")
            bb = attach(case.geometry, case.backend, group, timeout=60.0)
            try:
                for strategy in STRATEGIES:
                    bb.strategy = strategy
                    maps, unmaps = time_map_unmap(bb, rounds, warmup, case.geometry.num_pages)
                    out.append(_summary(case, world, strategy, maps, unmaps))
                    if log:
                        log(out[-1])
            finally:
                bb.close()
    return out


def rows_of(results: list[dict]) -> list[dict]:
    """Rows for the benchmark runner: median per-page latency, p99 in the note."""
    rows = []
    for r in results:
        where = "in-process (no broadcast)" if r["world"] is None else f"TP={r['world']} {r['strategy']}"
        for op in ("map", "unmap"):
            rows.append({"name": f"tp broadcast [{r['case']}] {where}: {op} one page id",
                         "value": r[f"{op}_us_p50"], "unit": "µs",
                         "note": f"median of {r['rounds']}; p99 {r[f'{op}_us_p99']} µs"})
    return rows


def run(quick: bool) -> list[dict]:
    rounds, warmup = (300, 30) if quick else (2000, 100)
    old = os.environ.get("KVCACHED_SHM_DIR")
    with tempfile.TemporaryDirectory(prefix="kvc-bench-tp-") as shm:
        os.environ["KVCACHED_SHM_DIR"] = shm  # the host ledger scans only this directory
        try:
            results = [r for case in HOST_CASES for r in measure_case(case, [1, 2, 4], rounds, warmup)]
        finally:
            if old is None:
                os.environ.pop("KVCACHED_SHM_DIR", None)
            else:
                os.environ["KVCACHED_SHM_DIR"] = old
    return rows_of(results)


def environment(backend: str) -> dict:
    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
           "machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()}
    if backend == "cuda":
        try:
            import pynvml

            pynvml.nvmlInit()
            env["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                           for i in range(pynvml.nvmlDeviceGetCount())]
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as exc:  # noqa: BLE001 - environment notes only
            env["gpus"] = f"unknown ({type(exc).__name__})"
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Tensor-parallel broadcast, {report['backend']} backend ({env['date']})", "",
             f"Machine: {env.get('gpus', env['machine'])}, {env['cpus']} CPUs, Python {env['python']}, "
             f"kernel {env['kernel']}" + (f", driver {env['driver']}" if env.get("driver") else "") + ".",
             "Single-page map and unmap through `BroadcastBackend` (Unix sockets, one worker process per rank);",
             "µs per page id, median (p99). In-process = the backend in the scheduler's own process.", "",
             "| case | TP | strategy | map p50 | map p99 | unmap p50 | unmap p99 |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        world = "-" if r["world"] is None else str(r["world"])
        lines.append(f"| {r['case']} | {world} | {r['strategy']} | {r['map_us_p50']} | {r['map_us_p99']} | "
                     f"{r['unmap_us_p50']} | {r['unmap_us_p99']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("host", "cuda"), default="host")
    ap.add_argument("--worlds", default="1,2,4", help="comma-separated TP sizes")
    ap.add_argument("--devices", help="comma-separated GPU per rank (cuda; default rank = GPU)")
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", type=Path, help="write tp-<backend>.json and .md here")
    ap.add_argument("--tag", help="file name stem (default tp-<backend>)")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    cases = CUDA_CASES if args.backend == "cuda" else HOST_CASES
    report = {"backend": args.backend, "environment": environment(args.backend), "results": []}
    print(json.dumps(report["environment"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="kvc-bench-tp-") as shm:
        os.environ.setdefault("KVCACHED_SHM_DIR", shm)
        for case in cases:
            report["results"] += measure_case(case, worlds, args.rounds, args.warmup, devices,
                                              log=lambda row: print(json.dumps(row), flush=True))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.tag or f"tp-{args.backend}"
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
