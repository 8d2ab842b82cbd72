"""kvtop --replay: any moment of a 24-hour recording on screen within 100 ms of asking for it.

A synthetic recording is written by the real Recorder: 16 models of 4096-page maps at 1 s, each map changing
30 pages a sample (a busy demo model's rate), the counters moving as a busy model's do; 24 hours of it, one day
file (the full run takes minutes to write; ``--quick``: 20 minutes of it). Then, at random moments:

- ``read``: what the replay's poller does for a moment asked (``ReplaySource``: the frame with the selected
  model's page map and the event log's lines, posted first; then the history of the 33 samples before it,
  which the sparklines and rates need, posted next), timed alone;
- ``on screen``: the headless dashboard (``ReplayApp`` under Textual's pilot) asked for the moment as ``g`` asks
  (the clock moved, the poller woken) until that frame is drawn, timed from the ask to the frame drawn.

    python -m benchmarks.replay_seek [--hours 24] [--seeks 40] [--keep DIR | --reuse DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from array import array
from dataclasses import replace
from pathlib import Path

from kvcached_core import ModelSnapshot, pagemap
from kvtop.frames.source import Frame
from kvtop.record.reading import Recording
from kvtop.record.recorder import Recorder

MODELS, PAGES, CHANGED = 16, 4096, 30
SELECTED = "model-03"
TARGET_MS = 100.0


def template(i: int) -> ModelSnapshot:
    return ModelSnapshot(name=f"model-{i:02d}", path=f"/dev/shm/kvc.model-{i:02d}", model="llama", engine="vllm",
                         backend="cuda", pid=1000 + i, uid=1000, device=i % 8, status="live", page_size=2 << 20,
                         block_bytes=1 << 16, num_layers=32, num_kv_buffers=2, blocks_per_page=32,
                         num_blocks=PAGES * 32, pages_total=PAGES, pages_inuse=0, pages_reserved=0, blocks_used=0,
                         blocks_cached=0, mapped_bytes=0, limit_bytes=None, limit_status="none")


def write_recording(directory: Path, samples: int, seed: int = 1) -> None:
    """``samples`` samples a second apart, ending now, into ``directory``'s day files."""
    rng = random.Random(seed)
    maps = [array("I", [pagemap.page_entry(True, rng.randint(1, 32), 0) if p < PAGES // 4 else 0
                        for p in range(PAGES)]) for _ in range(MODELS)]
    snaps = [template(i) for i in range(MODELS)]
    recorder = Recorder(directory, gpus=False)
    t0 = float(int(time.time()) - samples)
    for s in range(samples):
        for m in maps:
            for i in rng.sample(range(PAGES), CHANGED):
                m[i] = pagemap.page_entry(True, rng.randint(1, 32), rng.randint(0, 8))
        now_ns = int((t0 + s) * 1e9)
        models = tuple(replace(snap, heartbeat_ns=now_ns, read_ns=now_ns, updated_ns=now_ns,
                               alloc_count=s * 40 + i, alloc_blocks=s * 400 + i, free_count=s * 39,
                               blocks_used=1000 + (s * 7 + i * 13) % 3000, pages=array("I", m))
                       for i, (snap, m) in enumerate(zip(snaps, maps, strict=True)))
        recorder.write(Frame(models, (), (), "", 0, None, t0 + s, "host"))
    recorder.close()


def time_reads(path: Path, seeks: int, rng: random.Random) -> tuple[list[float], list[float]]:
    """Milliseconds the replay's poller takes for each moment asked: to the frame and its log lines (what it
    posts first), and to the history of the samples before it too (what it posts next)."""
    from kvtop.replay.source import ReplayClock, ReplaySource

    recording = Recording.open(path)
    clock = ReplayClock(recording.times())
    source = ReplaySource(recording, clock)
    out: list[float] = []
    history: list[float] = []
    try:
        for _ in range(seeks):
            clock.seek(rng.uniform(clock.start, clock.end))
            started = time.perf_counter()
            frame = source.read(SELECTED)
            source.log(frame.taken_at)
            out.append(1000 * (time.perf_counter() - started))
            source.continues(frame.taken_at)
            source.history(frame.taken_at)  # the sparklines' samples, read after the frame was posted
            history.append(1000 * (time.perf_counter() - started))
    finally:
        source.close()
    return out, history


def time_on_screen(path: Path, seeks: int, rng: random.Random) -> list[float]:
    """Milliseconds from asking for a moment to its frame drawn by the headless dashboard."""
    from kvtop.replay.app import ReplayApp

    app = ReplayApp(Recording.open(path), name=path.name, model=SELECTED)
    out: list[float] = []

    async def main() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            while app.frame is None or app.frame.detail is None:
                await pilot.pause(0.01)
            for _ in range(seeks):
                target = app.clock.sample_at(rng.uniform(app.clock.start, app.clock.end))
                started = time.perf_counter()
                app.clock.seek(target)
                app._clock_moved()
                while not (app.frame is not None and app.frame.taken_at == target and app.frame.detail is not None
                           and app.pagemap.detail is app.frame.detail):
                    await asyncio.sleep(0.001)
                out.append(1000 * (time.perf_counter() - started))
                await pilot.pause(0.05)  # let the screen settle between asks

    asyncio.run(main())
    return out


def summary(name: str, ms: list[float], note: str) -> dict:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"name": name, "value": round(statistics.median(ms), 1), "unit": "ms",
            "note": f"median of {len(ms)} random moments; p99 {p99:.1f} ms, max {ms[-1]:.1f} ms "
                    f"(target {TARGET_MS:.0f} ms); {note}"}


def measure(path: Path, seeks: int, hours: float) -> list[dict]:
    rng = random.Random(7)
    with Recording.open(path) as recording:
        span = (recording.end - recording.start) / 3600
        samples = len(recording.times())
    what = f"{span:.1f} h recording, {samples} samples of {MODELS} models x {PAGES} pages"
    reads, with_history = time_reads(path, seeks, rng)
    return [summary(f"replay seek: the poller's read ({hours:g} h recording)", reads, what),
            summary(f"replay seek: the read and the sparklines' history ({hours:g} h recording)", with_history,
                    what + "; the 33 samples before the moment, posted after the frame"),
            summary(f"replay seek: ask to frame on screen ({hours:g} h recording)",
                    time_on_screen(path, seeks, rng), what + ", headless 160x50")]


def run(quick: bool) -> list[dict]:
    hours = 1 / 3 if quick else 24.0
    with tempfile.TemporaryDirectory(prefix="replay-seek-") as tmp:
        write_recording(Path(tmp), int(hours * 3600))
        return measure(Path(tmp), 10 if quick else 40, hours)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--seeks", type=int, default=40)
    parser.add_argument("--keep", type=Path, help="write the recording here and keep it")
    parser.add_argument("--reuse", type=Path, help="measure a recording written before with --keep")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="replay-seek-") as tmp:
        path = args.reuse or args.keep or Path(tmp)
        if args.reuse is None:
            started = time.monotonic()
            write_recording(path, int(args.hours * 3600))
            print(f"wrote {args.hours:g} h in {time.monotonic() - started:.0f} s to {path}")
        print("| measure | median | note |\n|---|---|---|")
        for row in measure(path, args.seeks, args.hours):
            print(f"| {row['name']} | {row['value']} {row['unit']} | {row['note']} |")


if __name__ == "__main__":
    main()
