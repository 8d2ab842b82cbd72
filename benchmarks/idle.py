"""What idle allocators cost, and how fast an idle allocator acknowledges a limit.

* CPU of a process holding 1 or 50 idle allocators (after some traffic, then none): the time
  its threads ran (``/proc/PID/task/*/schedstat``) over a quiet interval, as a percentage of one
  core. One poller thread serves every allocator of a process; a controller pokes it, so an
  idle allocator costs its heartbeat (4 ticks a second) and its idle refill thread's rare wake-ups.
* limit acknowledgement latency: ``request_limit`` against one of those idle allocators, each
  request at a random moment, until the call returns with the allocator's acknowledgement.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from ._common import percentile, private_segments, spawn, stop

HOLDER = """
import sys
from kvcached_core.allocator.manager import KVCacheManager
ms = [KVCacheManager(f"idle{{i}}", name=f"idle{{i}}", num_blocks=256, block_bytes=16384, num_layers=1,
                     page_size=256 * 1024) for i in range({count})]
for m in ms:
    m.free(m.alloc(4))
print("READY", flush=True)
sys.stdin.readline()
for m in ms:
    m.close()
"""


def cpu_ns(pid: int) -> int:
    """Nanoseconds all threads of ``pid`` have run (field 1 of each task's schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total


def idle_cpu_percent(count: int, seconds: float) -> float:
    child = spawn(HOLDER.format(count=count))
    try:
        time.sleep(1.0)  # past start-up and the last traffic's refill
        before, t0 = cpu_ns(child.pid), time.monotonic()
        time.sleep(seconds)
        used, elapsed = cpu_ns(child.pid) - before, time.monotonic() - t0
    finally:
        stop(child)
    return 100.0 * used / (elapsed * 1e9)


def ack_latencies_ms(rounds: int) -> list[float]:
    from kvcached_core.control.requests import request_limit

    rng = random.Random(7)
    child = spawn(HOLDER.format(count=1))
    try:
        samples = []
        for i in range(rounds):
            time.sleep(rng.uniform(0, 0.02))
            t0 = time.monotonic()
            ack = request_limit("idle0", (64 + i % 2) << 20, wait=5)
            samples.append((time.monotonic() - t0) * 1e3)
            assert ack.status == "applied", ack
    finally:
        stop(child)
    return sorted(samples)


def run(quick: bool) -> list[dict]:
    seconds, rounds = (3.0, 100) if quick else (10.0, 400)
    with private_segments():
        one = idle_cpu_percent(1, seconds)
        fifty = idle_cpu_percent(50, seconds)
        acks = ack_latencies_ms(rounds)
    note = f"CPU time of all its threads over {seconds:g} s of no traffic (schedstat), per cent of one core"
    return [
        {"name": "idle allocator, one per process", "value": round(one, 3), "unit": "% of a core",
         "note": f"{note}; target at most 0.1"},
        {"name": "50 idle allocators in one process", "value": round(fifty, 3), "unit": "% of a core",
         "note": f"{note}; one poller thread serves all 50"},
        {"name": "limit acknowledged by an idle allocator", "value": round(percentile(acks, 50), 2),
         "unit": "ms p50", "note": f"p99 {percentile(acks, 99):.2f} ms over {rounds} requests (target p99 at most 20 ms)"},
    ]


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
