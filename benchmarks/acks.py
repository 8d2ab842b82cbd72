"""Limit and trim acknowledgement latency against an allocator in another process.

* ours: ``request_limit`` / ``request_trim`` from this process against a KVCacheManager in a
  child; the time until the call returns with the allocator's acknowledgement (status applied,
  bytes returned), read back from the segment. The controller pokes the allocator's poller
  (``kvcached_core.allocator.poller``), which applies the request at once.
* upstream-style: the controller rewrites the total field of the 24-byte file under an
  exclusive flock; a watcher thread in the child polls the file every ``UPSTREAM_POLL_S`` (open,
  shared flock, mmap, read, close), as upstream's background watcher does, and applies the new
  limit. Upstream has no acknowledgement: the controller cannot know when (or whether) it
  was applied, so we measure the time until the child has applied it (the child reports the
  moment over a pipe; CLOCK_MONOTONIC is shared by all processes). Upstream cannot trim from
  outside at all.
"""

from __future__ import annotations

import random
import time

from ._common import legacy_create, legacy_set_limit, percentile, private_segments, spawn, stop

UPSTREAM_POLL_S = 0.005  # the upstream-style watcher's polling interval (upstream's own watcher polls too)

ALLOCATOR = """
import sys
from kvcached_core.allocator.manager import KVCacheManager
m = KVCacheManager("bench-acks", name="bench-acks", num_blocks=4096, block_bytes=16384, num_layers=1,
                   page_size=256 * 1024)
m.free(m.alloc(4))
print("READY", flush=True)
sys.stdin.readline()
m.close()
"""

UPSTREAM_WATCHER = """
import sys, threading, time
from pathlib import Path
from benchmarks._common import legacy_read
from benchmarks.acks import UPSTREAM_POLL_S as WATCH_INTERVAL_S
path = Path(PATH)
applied = legacy_read(path)[0]

def watch():
    global applied
    while True:
        time.sleep(WATCH_INTERVAL_S)
        total = legacy_read(path)[0]
        if total != applied:
            applied = total  # where upstream resizes its KV cache
            print(f"APPLIED {total} {time.monotonic()}", flush=True)

threading.Thread(target=watch, daemon=True).start()
print("READY", flush=True)
sys.stdin.readline()
"""


def _jitter() -> None:
    """Requests arrive at random moments relative to the watcher's polling."""
    time.sleep(_rng.uniform(0, 0.006))


_rng = random.Random(6)


def _stats_ms(samples: list[float]) -> tuple[float, float]:
    values = sorted(samples)
    return percentile(values, 50) * 1e3, percentile(values, 99) * 1e3


def _ours(rounds: int) -> dict[str, list[float]]:
    """Latency until the acknowledgement is back, and until the allocator applied the request
    (the ``updated_ns`` of the publish that carried the acknowledgement: the child is otherwise idle)."""
    from kvcached_core.control.requests import request_limit, request_trim
    from kvcached_core.segment.reader import snapshot

    out: dict[str, list[float]] = {"limit": [], "limit applied": [], "trim": [], "trim applied": []}
    child = spawn(ALLOCATOR)
    try:
        for i in range(rounds):
            for kind in ("limit", "trim"):
                _jitter()
                t0, wall0 = time.monotonic(), time.time_ns()
                if kind == "limit":
                    ack = request_limit("bench-acks", (64 + i % 2) * 1024 * 1024, wait=5.0)
                    assert ack.status == "applied", ack
                else:
                    request_trim("bench-acks", wait=5.0)
                out[kind].append(time.monotonic() - t0)
                out[kind + " applied"].append((snapshot("bench-acks", with_pages=False).updated_ns - wall0) / 1e9)
    finally:
        stop(child)
    return out


def _upstream(directory, rounds: int) -> list[float]:
    path = directory / "kvcached_bench_acks"
    legacy_create(path, 1 << 30)
    child = spawn(UPSTREAM_WATCHER.replace("PATH", repr(str(path))))
    latencies: list[float] = []
    try:
        for i in range(rounds):
            total = (1 << 30) + (i + 1) * 4096
            _jitter()
            t0 = time.monotonic()
            legacy_set_limit(path, total)
            line = child.stdout.readline().split()  # type: ignore[union-attr]
            assert line[:2] == ["APPLIED", str(total)], line
            latencies.append(float(line[2]) - t0)
    finally:
        stop(child)
    return latencies


def run(quick: bool) -> list[dict]:
    rounds = 100 if quick else 500
    with private_segments() as directory:
        ours = _ours(rounds)
        upstream = _upstream(directory, rounds)
    poll = "the controller pokes the allocator"
    rows = []
    for label, samples, note in (
        ("limit acknowledged: ours (request_limit returns)", ours["limit"],
         f"{rounds} requests; {poll}; the controller polls for the acknowledgement"),
        ("limit applied: ours (allocator published it)", ours["limit applied"], f"{rounds} requests; {poll}"),
        ("trim acknowledged: ours (request_trim returns)", ours["trim"], f"{rounds} requests; {poll}"),
        ("trim applied: ours (allocator published it)", ours["trim applied"], f"{rounds} requests; {poll}"),
        ("limit applied: upstream-style (flock write, watcher polls)", upstream,
         f"{rounds} requests; watcher polls every {UPSTREAM_POLL_S * 1e3:g} ms; no acknowledgement exists, "
         "upstream cannot trim from outside"),
    ):
        p50, p99 = _stats_ms(samples)
        rows.append({"name": label, "value": round(p50, 2), "unit": "ms p50", "note": f"p99 {p99:.2f} ms; {note}"})
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
