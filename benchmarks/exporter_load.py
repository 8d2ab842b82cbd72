"""``kvctl export`` under many scrapers at once: 50 threads scrape /metrics together, round after round.

``kvctl export`` runs in its own process (without ``--interval``: scrapes read the segments) and
serves 8 live allocators of another. A scrape's latency is from opening the connection to the
last byte read.
Scrapes that arrive while a read of the segments runs share it, and the listen backlog holds
them all, so none waits out a TCP SYN retry (1 s, then 3 s, then 7 s).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request

from ._common import child_env, percentile, private_segments, spawn, stop

MODELS = """
import sys
from kvcached_core.allocator.manager import KVCacheManager
ms = [KVCacheManager(f"scraped{i}", name=f"scraped{i}", num_blocks=1024, block_bytes=16384, num_layers=1,
                     page_size=256 * 1024) for i in range(8)]
for m in ms:
    m.alloc(40)
print("READY", flush=True)
sys.stdin.readline()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exporter(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "export", "--port", str(port)], env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("kvctl export did not start")


def _scrape(port: int) -> bool:
    """One scrape with a plain socket (a client this cheap measures the server, not itself)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
    except OSError:
        return False
    return data.startswith(b"HTTP/1.0 200") and b"kvcached_model_info" in data


def scrape_latencies_ms(scrapers: int, rounds: int) -> tuple[list[float], int]:
    """Latencies of ``scrapers`` x ``rounds`` scrapes (each round starts all scrapers together) and failures."""
    child = spawn(MODELS)
    port = _free_port()
    exporter = _exporter(port)
    samples: list[float] = []
    failures = 0
    lock = threading.Lock()
    try:
        for _ in range(rounds):
            start = threading.Barrier(scrapers)

            def one(start: threading.Barrier = start) -> None:
                nonlocal failures
                start.wait()
                t0 = time.monotonic()
                ok = _scrape(port)
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
        stop(exporter)
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
