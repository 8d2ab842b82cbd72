"""``kvctl export`` under many scrapers at once: 50 threads scrape /metrics together, round after round.

The exporter (without ``--interval``: every scrape reads the segments) serves 8 live allocators
of a child process. A scrape's latency is from opening the connection to the last byte read.
Scrapes that arrive while a read of the segments runs share it, and the listen backlog holds
them all, so none waits out a TCP SYN retry (1 s, then 3 s, then 7 s).
"""

from __future__ import annotations

import threading
import time
import urllib.request

from ._common import percentile, private_segments, spawn, stop

MODELS = """
import sys
from kvcached_core.manager import KVCacheManager
ms = [KVCacheManager(f"scraped{i}", name=f"scraped{i}", num_blocks=1024, block_bytes=16384, num_layers=1,
                     page_size=256 * 1024) for i in range(8)]
for m in ms:
    m.alloc(40)
print("READY", flush=True)
sys.stdin.readline()
"""


def scrape_latencies_ms(scrapers: int, rounds: int) -> tuple[list[float], int]:
    """Latencies of ``scrapers`` x ``rounds`` scrapes (each round starts all scrapers together) and failures."""
    from kvtop.exporter import Exporter

    child = spawn(MODELS)
    samples: list[float] = []
    failures = 0
    lock = threading.Lock()
    try:
        with Exporter(port=0, with_nvml=False) as exporter:
            for _ in range(rounds):
                start = threading.Barrier(scrapers)

                def one(start: threading.Barrier = start) -> None:
                    nonlocal failures
                    start.wait()
                    t0 = time.monotonic()
                    try:
                        with urllib.request.urlopen(exporter.url, timeout=30) as response:
                            response.read()
                        ok = True
                    except OSError:
                        ok = False
                    elapsed = (time.monotonic() - t0) * 1e3
                    with lock:
                        if ok:
                            samples.append(elapsed)
                        else:
                            failures += 1

                threads = [threading.Thread(target=one) for _ in range(scrapers)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
    finally:
        stop(child)
    return sorted(samples), failures


def run(quick: bool) -> list[dict]:
    scrapers, rounds = 50, (5 if quick else 20)
    with private_segments():
        samples, failures = scrape_latencies_ms(scrapers, rounds)
    return [{
        "name": f"kvctl export: {scrapers} scrapers at once", "value": round(percentile(samples, 50), 1),
        "unit": "ms p50",
        "note": (f"p99 {percentile(samples, 99):.1f} ms, max {samples[-1]:.1f} ms over {len(samples)} scrapes "
                 f"({rounds} rounds), {failures} failed; 8 live models; target p99 under 100 ms"),
    }]


if __name__ == "__main__":
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
