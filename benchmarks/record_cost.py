"""kvctl record's cost: CPU per sample and bytes per day for 16 models of 4096-page maps at 1 s.

Frames are made here (no segments read: the read's own cost is kvtop's refresh, measured elsewhere) and written
by the real Recorder into a real day file. Three shapes: ``busy`` (30 pages of each map change a sample, the
changed pages per second a busy demo model shows), ``tenth`` (a tenth of every map changes a sample) and
``worst`` (every page of every map changes every sample). Counters change as a busy model's do (heartbeat,
read time, allocation counts). Prints one Markdown table; ``--seek`` also times Recording.frame_at at random
moments of the recording written.

    python -m benchmarks.record_cost [--samples 600] [--seek]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from array import array
from dataclasses import replace
from pathlib import Path

from kvcached_core import ModelSnapshot, pagemap
from kvtop.record.reading import Recording
from kvtop.record.recorder import Recorder
from kvtop.record.retention import recording_size
from kvtop.source import Frame

MODELS, PAGES, DAY = 16, 4096, 86_400


def template(i: int) -> ModelSnapshot:
    return ModelSnapshot(name=f"model-{i:02d}", path=f"/dev/shm/kvc.model-{i:02d}", model="llama", engine="vllm",
                         backend="cuda", pid=1000 + i, uid=1000, device=i % 8, status="live", page_size=2 << 20,
                         block_bytes=1 << 16, num_layers=32, num_kv_buffers=2, blocks_per_page=32,
                         num_blocks=PAGES * 32, pages_total=PAGES, pages_inuse=0, pages_reserved=0, blocks_used=0,
                         blocks_cached=0, mapped_bytes=0, limit_bytes=None, limit_status="none")


def step(rng: random.Random, pages: array, shape: str) -> array:
    out = array("I", pages)
    n = {"busy": 30, "tenth": PAGES // 10, "worst": PAGES}[shape]
    for i in (range(PAGES) if shape == "worst" else rng.sample(range(PAGES), n)):
        out[i] = pagemap.page_entry(True, rng.randint(1, 32), rng.randint(0, 8))
    return out


def run(shape: str, samples: int, seek: bool) -> dict:
    rng = random.Random(1)
    maps = [array("I", [pagemap.page_entry(True, rng.randint(0, 32), 0) if p < PAGES // 4 else 0
                        for p in range(PAGES)]) for _ in range(MODELS)]
    snaps = [template(i) for i in range(MODELS)]
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(Path(tmp), gpus=False)
        t0 = time.time() - samples
        cpu = 0.0
        for s in range(samples):
            maps = [step(rng, m, shape) for m in maps]
            now_ns = int((t0 + s) * 1e9)
            models = tuple(replace(snap, heartbeat_ns=now_ns - rng.randint(0, 10**8), read_ns=now_ns,
                                   updated_ns=now_ns - rng.randint(0, 10**9), alloc_count=s * 40 + rng.randint(0, 9),
                                   free_count=s * 39, blocks_used=rng.randint(1000, 4000), pages=m)
                           for snap, m in zip(snaps, maps, strict=True))
            frame = Frame(models, (), (), "", 0, None, t0 + s, "host")
            started = time.process_time()
            recorder.write(frame)
            cpu += time.process_time() - started
        recorder.close()
        assert recorder.path is not None
        size = recording_size(recorder.path)
        out = {"shape": shape, "samples": samples, "cpu_ms": 1000 * cpu / samples,
               "core_pct": 100 * cpu / samples, "bytes": size / samples, "mb_day": size / samples * DAY / 1e6}
        if seek:
            with Recording.open(recorder.path) as rec:
                times = rec.times()
                worst = 0.0
                for _ in range(50):
                    started = time.perf_counter()
                    rec.frame_at(rng.choice(times), "model-03")
                    worst = max(worst, time.perf_counter() - started)
                out["seek_ms_max"] = 1000 * worst
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--seek", action="store_true")
    parser.add_argument("--shapes", default="busy,tenth,worst")
    args = parser.parse_args()
    print(f"{MODELS} models x {PAGES} pages, {args.samples} samples at 1 s, key sample every 60")
    print("| shape | CPU ms/sample | % of one core at 1 s | bytes/sample | MB/day |" + (" seek max ms |" if args.seek else ""))
    print("|---|---|---|---|---|" + ("---|" if args.seek else ""))
    for shape in args.shapes.split(","):
        r = run(shape, args.samples, args.seek)
        row = f"| {shape} | {r['cpu_ms']:.2f} | {r['core_pct']:.2f} | {r['bytes']:.0f} | {r['mb_day']:.1f} |"
        print(row + (f" {r['seek_ms_max']:.1f} |" if args.seek else ""))


if __name__ == "__main__":
    main()
