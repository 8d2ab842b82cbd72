"""kvctl record's cost: CPU per sample and bytes per day for 16 models of 4096-page maps at 1 s.

Frames are made here (no segments read: the read's own cost is kvtop's refresh, measured elsewhere) and written
by the real Recorder into a real day file. Four shapes:

- ``demo``: each map changes as a busy demo model's does (measured on ``kvtop.demo.fleet``'s fleet: about 30 pages
  a map a second, in runs of neighbours among its mapped quarter: gaps between changed pages 1 (56 %), 2
  (20 %), 3 (9 %), 4-20 (15 %); a page's used blocks moving by a few, its cached blocks mostly unchanged);
- ``busy``: 30 pages anywhere in each map take random words each sample (a page's used and cached blocks
  drawn anew: no demo model does this, it is what the changes cost when nothing about them repeats);
- ``tenth``: a tenth of every map, random words; ``worst``: every page of every map, every sample.

A sample's bytes are what the day file grew by per sample, its empty tables' pages (a fixed cost per day
file) counted once a day. Counters change as a busy model's do (heartbeat, read time, allocation counts). Prints one Markdown table;
``--seek`` also times Recording.frame_at at random moments of the recording written; ``--hours H`` writes an
H-hour ``demo`` recording (24: a day, about 10 minutes on one core) and times, at random moments, what
kvtop --replay asks for a moment: the frame with a model's page map, then the 33 frames before it.

    python -m benchmarks.record_cost [--samples 600] [--seek] [--shapes demo,busy,tenth,worst] [--hours 24]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from array import array
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from kvcached_core import ModelSnapshot, pagemap
from kvtop.frames.source import Frame
from kvtop.record.reading import Recording
from kvtop.record.recorder import Recorder
from kvtop.record.retention import recording_size
from kvtop.record.schema import KEY_EVERY, create

MODELS, PAGES, DAY = 16, 4096, 86_400


def template(i: int) -> ModelSnapshot:
    return ModelSnapshot(name=f"model-{i:02d}", path=f"/dev/shm/kvc.model-{i:02d}", model="llama", engine="vllm",
                         backend="cuda", pid=1000 + i, uid=1000, device=i % 8, status="live", page_size=2 << 20,
                         block_bytes=1 << 16, num_layers=32, num_kv_buffers=2, blocks_per_page=32,
                         num_blocks=PAGES * 32, pages_total=PAGES, pages_inuse=0, pages_reserved=0, blocks_used=0,
                         blocks_cached=0, mapped_bytes=0, limit_bytes=None, limit_status="none")


# The demo fleet's page-map changes, measured (gap to the next changed page; a used-count change; a cached one).
GAPS = ((1, 56), (2, 20), (3, 9), (4, 6), (5, 3), (6, 2), (8, 2), (12, 1), (20, 1))
USED_STEPS = ((0, 20), (-1, 11), (16, 10), (-2, 9), (-3, 5), (2, 5), (-16, 4), (-4, 4), (1, 3), (-6, 3), (-5, 3),
              (3, 2))
CACHED_STEPS = ((0, 80), (16, 4), (-16, 4), (10, 1), (-10, 1), (-8, 1), (-2, 1), (8, 1), (5, 1))


def _draw(rng: random.Random, table: tuple[tuple[int, int], ...]) -> int:
    return rng.choices([v for v, _ in table], [w for _, w in table])[0]


def demo_step(rng: random.Random, pages: array) -> array:
    out = array("I", pages)
    index = rng.randrange(PAGES // 4)
    for _ in range(30):
        index = (index + _draw(rng, GAPS)) % (PAGES // 4)
        _mapped, used, cached = pagemap.decode_page(out[index])
        used = min(32, max(0, used + _draw(rng, USED_STEPS)))
        cached = min(32 - used, max(0, cached + _draw(rng, CACHED_STEPS)))
        out[index] = pagemap.page_entry(True, used, cached)
    return out


def step(rng: random.Random, pages: array, shape: str) -> array:
    if shape == "demo":
        return demo_step(rng, pages)
    out = array("I", pages)
    n = {"busy": 30, "tenth": PAGES // 10, "worst": PAGES}[shape]
    for i in (range(PAGES) if shape == "worst" else rng.sample(range(PAGES), n)):
        out[i] = pagemap.page_entry(True, rng.randint(1, 32), rng.randint(0, 8))
    return out


def frames(shape: str, samples: int, t0: float, seed: int = 1) -> Iterator[Frame]:
    """``samples`` frames a second apart from ``t0``, every map changing as ``shape`` says."""
    rng = random.Random(seed)
    maps = [array("I", [pagemap.page_entry(True, rng.randint(0, 32), 0) if p < PAGES // 4 else 0
                        for p in range(PAGES)]) for _ in range(MODELS)]
    snaps = [template(i) for i in range(MODELS)]
    for s in range(samples):
        maps = [step(rng, m, shape) for m in maps]
        now_ns = int((t0 + s) * 1e9)
        models = tuple(replace(snap, heartbeat_ns=now_ns - rng.randint(0, 10**8), read_ns=now_ns,
                               updated_ns=now_ns - rng.randint(0, 10**9), alloc_count=s * 40 + rng.randint(0, 9),
                               free_count=s * 39, blocks_used=rng.randint(1000, 4000), pages=m)
                       for snap, m in zip(snaps, maps, strict=True))
        yield Frame(models, (), (), "", 0, None, t0 + s, "host")


def seek_times(path: Path, rng: random.Random, seeks: int, history: int = 0) -> list[float]:
    """Seconds for ``frame_at`` at random moments with model-03's page map (and the ``history`` frames
    before it, as kvtop --replay asks), from a recording opened once."""
    out = []
    with Recording.open(path) as rec:
        times = rec.times()
        for _ in range(seeks):
            i = rng.randrange(len(times))
            started = time.perf_counter()
            rec.frame_at(times[i], "model-03")
            for j in range(max(0, i - history), i):
                rec.frame_at(times[j], None)
            out.append(time.perf_counter() - started)
    return out


def empty_size(path: Path) -> int:
    """A day file's bytes before its first sample (its tables' first pages): counted once a day, not a sample."""
    create(path, {}).close()
    return recording_size(path)


def measure(shape: str, samples: int, seek: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(Path(tmp), gpus=False)
        cpu = 0.0
        for frame in frames(shape, samples, time.time() - samples):
            started = time.process_time()
            recorder.write(frame)
            cpu += time.process_time() - started
        recorder.close()
        assert recorder.path is not None
        empty = empty_size(Path(tmp) / "empty.sqlite")
        grown = (recording_size(recorder.path) - empty) / samples
        out = {"shape": shape, "samples": samples, "cpu_ms": 1000 * cpu / samples,
               "core_pct": 100 * cpu / samples, "bytes": grown, "mb_day": (grown * DAY + empty) / 1e6}
        if seek:
            out["seek_ms_max"] = 1000 * max(seek_times(recorder.path, random.Random(2), 50))
        return out


def long_recording(hours: float, seeks: int) -> str:
    """An ``hours``-long demo recording, written and sought: a Markdown table."""
    samples = int(hours * 3600)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        day_start = (time.time() // DAY - 2) * DAY  # one UTC day file, two days ago
        recorder = Recorder(directory, gpus=False)
        started = time.perf_counter()
        for frame in frames("demo", samples, day_start):
            recorder.write(frame)
        recorder.close()
        wrote = time.perf_counter() - started
        assert recorder.path is not None
        size = recording_size(recorder.path)
        started = time.perf_counter()
        with Recording.open(directory):
            pass
        opened = time.perf_counter() - started
        alone = [1000 * s for s in seek_times(directory, random.Random(3), seeks)]
        replayed = [1000 * s for s in seek_times(directory, random.Random(4), seeks, history=33)]
    rows = [f"{hours:g} h demo recording: {samples} samples, {size / 1e6:.1f} MB, written in {wrote:.0f} s; "
            f"opened in {1000 * opened:.0f} ms; {seeks} random moments each",
            "", "| ask | median ms | max ms |", "|---|---|---|",
            f"| a moment with a model's page map | {statistics.median(alone):.1f} | {max(alone):.1f} |",
            f"| the same and the 33 moments before it (kvtop --replay's history) | "
            f"{statistics.median(replayed):.1f} | {max(replayed):.1f} |"]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--seek", action="store_true")
    parser.add_argument("--shapes", default="demo,busy,tenth,worst")
    parser.add_argument("--hours", type=float, default=0.0, help="also write and seek a demo recording this long")
    parser.add_argument("--seeks", type=int, default=50)
    args = parser.parse_args()
    if args.shapes:
        print(f"{MODELS} models x {PAGES} pages, {args.samples} samples at 1 s, key sample every {KEY_EVERY}")
        print("| shape | CPU ms/sample | % of one core at 1 s | bytes/sample | MB/day |"
              + (" seek max ms |" if args.seek else ""))
        print("|---|---|---|---|---|" + ("---|" if args.seek else ""))
        for shape in args.shapes.split(","):
            r = measure(shape, args.samples, args.seek)
            row = f"| {shape} | {r['cpu_ms']:.2f} | {r['core_pct']:.2f} | {r['bytes']:.0f} | {r['mb_day']:.1f} |"
            print(row + (f" {r['seek_ms_max']:.1f} |" if args.seek else ""), flush=True)
    if args.hours:
        print()
        print(long_recording(args.hours, args.seeks))


if __name__ == "__main__":
    main()
