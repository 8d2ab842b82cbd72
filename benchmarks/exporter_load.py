"""``kvctl export`` under many scrapers at once: 50 threads scrape /metrics together, round after round.

``kvctl export`` runs in its own process (without ``--interval``: scrapes read the segments) and
serves 8 live allocators of another. A scrape's latency is from opening the connection to the
last byte read.
Scrapes that arrive while a read of the segments runs share it, and the listen backlog holds
them all, so none waits out a TCP SYN retry (1 s, then 3 s, then 7 s).

``python -m benchmarks.exporter_load --compare-with REV`` measures this tree's exporter against the
one of git revision REV in the same run: ``kvtop/`` of REV is extracted into a temporary directory
and put first on the second exporter's path (its working directory too) (``kvcached_core`` stays this tree's, so both read the
segments the same way); both exporters serve the same models throughout, one discarded warm-up run
each, then runs in ABBA order; every run is printed, then the median and range of each side's p99
and of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ._common import ROOT, child_env, percentile, private_segments, spawn, stop

EXPORTER_FILES = ("kvtop/serve/exporter.py", "kvtop/serve/http_page.py", "kvtop/serve/aioserve.py", "kvtop/cli/export.py")
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


def _exporter(port: int, first_on_path: Path | None = None) -> subprocess.Popen:
    env = child_env()
    if first_on_path is not None:
        env["PYTHONPATH"] = str(first_on_path) + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "export", "--port", str(port)], env=env,
                            cwd=first_on_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def measure(port: int, scrapers: int, rounds: int) -> tuple[list[float], int]:
    """Latencies of ``scrapers`` x ``rounds`` scrapes of a running exporter (each round starts all scrapers
    together), sorted, and the number that failed."""
    samples: list[float] = []
    failures = 0
    lock = threading.Lock()
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
    return sorted(samples), failures


def scrape_latencies_ms(scrapers: int, rounds: int) -> tuple[list[float], int]:
    """:func:`measure` of this tree's exporter, started for it, serving 8 live models."""
    child = spawn(MODELS)
    port = _free_port()
    exporter = _exporter(port)
    try:
        return measure(port, scrapers, rounds)
    finally:
        stop(exporter)
        stop(child)


@contextlib.contextmanager
def tree_of(rev: str) -> Iterator[Path]:
    """A temporary directory holding ``kvtop/`` as it was at git revision ``rev``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "kvtop"], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryDirectory(prefix="kvc-exporter-") as directory:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(directory, filter="data")
        env = child_env()
        env["PYTHONPATH"] = directory + os.pathsep + env["PYTHONPATH"]
        where = subprocess.run([sys.executable, "-c", "import kvtop.serve.exporter; print(kvtop.serve.exporter.__file__)"],
                               env=env, cwd=directory, check=True, capture_output=True, text=True).stdout.strip()
        if not where.startswith(directory):
            raise RuntimeError(f"the exporter of {rev} is not the one imported ({where})")
        yield Path(directory)


def _row(samples: list[float], failures: int) -> dict[str, float]:
    return {"p50": percentile(samples, 50), "p99": percentile(samples, 99), "max": samples[-1] if samples else
            float("nan"), "scrapes": len(samples), "failed": failures}


def compare(rev: str, pairs: int, rounds: int, scrapers: int = 50) -> None:
    """This tree's exporter (B) against the one of ``rev`` (A), both serving the same 8 models throughout."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *EXPORTER_FILES], check=True,
                           capture_output=True, text=True).stdout.strip()
    names = {"A": f"{rev} (before)", "B": f"{head}{' + uncommitted exporter files' if dirty else ''} (now)"}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    with private_segments(), tree_of(rev) as old:
        child = spawn(MODELS)
        ports = {"A": _free_port(), "B": _free_port()}
        exporters = [_exporter(ports["A"], old), _exporter(ports["B"])]
        try:
            for side in "AB":
                measure(ports[side], scrapers, rounds)  # warm-up, discarded
            for pair in range(pairs):
                for side in ("AB" if pair % 2 == 0 else "BA"):
                    load = os.getloadavg()[0]
                    row = _row(*measure(ports[side], scrapers, rounds))
                    runs[side].append(row)
                    print(f"pair {pair + 1} {side} {names[side]}: p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms, "
                          f"max {row['max']:.1f} ms, {row['scrapes']} scrapes, {row['failed']} failed; "
                          f"load {load:.1f}", flush=True)
        finally:
            for proc in exporters:
                stop(proc)
            stop(child)
    print(f"\n{pairs} pairs, {rounds} rounds of {scrapers} scrapers per run, 8 live models; "
          f"{os.cpu_count()} CPUs", flush=True)
    for side in "AB":
        for figure in ("p50", "p99"):
            values = [r[figure] for r in runs[side]]
            print(f"{names[side]}: {figure} median {statistics.median(values):.1f} ms, "
                  f"range {min(values):.1f}-{max(values):.1f} ms")
    ratios = [b["p99"] / a["p99"] for a, b in zip(runs["A"], runs["B"], strict=True)]
    print(f"p99 now / before, per pair: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
          f"{max(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exporter_load", description=__doc__.splitlines()[0])
    parser.add_argument("--compare-with", metavar="REV", help="git revision whose exporter to measure against")
    parser.add_argument("--pairs", type=int, default=4, help="ABBA pairs of runs (with --compare-with)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 50 scrapers per run (with --compare-with)")
    args = parser.parse_args(argv)
    if args.compare_with:
        compare(args.compare_with, args.pairs, args.rounds)
        return 0
    for row in run(quick=True):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
