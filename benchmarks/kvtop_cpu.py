"""kvtop's cost as an operator pays it: time to the first frame, and CPU while watching a large fleet.

The fleet: 16 real KVCacheManagers (host backend) of 65,536 pages each, in one helper child
process. Pages are small (64 KiB, one layer, K/V: a 128 KiB bundle) so that only the ~64
pages per model that traffic maps cost memory; a thread in the helper allocates and frees a
block on every model every 50 ms, so page maps really change between refreshes.

* ``first_frame``: seconds from spawning ``kvtop`` in a pseudo-terminal (160x50) until the
  screen shows the fleet: a model row and the selected model's page-map title.
* ``kvtop_cpu``: kvtop's own CPU seconds (user + system, from /proc via psutil) over wall
  seconds while it refreshes 4 times a second (``--interval 0.25``), as a percentage of one
  core. Target: at most 10 %.
* ``snapshot_reads_cpu``: the same 4 reads a second (``LiveSource.read``: ``scan()`` of the 16
  counters plus the selected model's 256 KiB page map), in a process of their own, nothing
  drawn: what kvtop cannot avoid.
* ``snapshot_read``: the median time of one such read.

Run alone: ``python benchmarks/kvtop_cpu.py [--quick]``.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = 16
PAGES = 65_536
INTERVAL_S = 0.25
COLS, ROWS = 160, 50
ANSI = re.compile(rb"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]|\x1b\][^\x07]*\x07|\x1b.")

HELPER = textwrap.dedent("""
    import random, sys, threading, time
    from kvcached_core import KVCacheManager
    models = []
    for i in range(int(sys.argv[1])):
        m = KVCacheManager(f"bench-{i:02d}", name=f"bench-{i:02d}", num_blocks=int(sys.argv[2]) * 4,
                           block_bytes=16384, num_layers=1, page_size=65536, engine="bench")
        models.append((m, [m.alloc(1) for _ in range(160)]))
    rng = random.Random(0)
    for m, held in models:  # scatter: free every other block so pages are partly used
        for ids in held[::2]:
            m.free(ids)
        del held[::2]

    def traffic():
        while True:
            for m, held in models:
                got = m.alloc(1)
                if got:
                    held.append(got)
                if len(held) > 60:
                    m.free(held.pop(rng.randrange(len(held))))
            time.sleep(0.05)

    threading.Thread(target=traffic, daemon=True).start()
    print("READY", flush=True)
    sys.stdin.read()
""")


def _env(directory: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(KVCACHED_SHM_DIR=str(directory), KVCACHED_HOST_CAPACITY="2GiB", KVCACHED_MIN_RESERVED_PAGES="1",
               KVCACHED_MAX_RESERVED_PAGES="2", TERM="xterm-256color", COLUMNS=str(COLS), LINES=str(ROWS))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _kvtop() -> list[str]:
    script = Path(sys.executable).parent / "kvtop"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtop.app"]


def _start_fleet(env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HELPER, str(MODELS), str(PAGES)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"the benchmark fleet did not start: {line!r}")
    return proc


def _reads_alone(env: dict[str, str], seconds: float) -> tuple[float, float]:
    """(CPU share of one core, median read seconds) of LiveSource.read at 4 Hz in a fresh process."""
    code = textwrap.dedent(f"""
        import json, statistics, time
        from kvtop.frames.source import LiveSource
        src = LiveSource()
        src.read("bench-00")
        cpu0, wall0, times = time.process_time(), time.monotonic(), []
        next_at = wall0
        while time.monotonic() - wall0 < {seconds}:
            t = time.perf_counter()
            frame = src.read("bench-00")
            times.append(time.perf_counter() - t)
            assert len(frame.models) == {MODELS} and len(frame.detail.pages) == {PAGES}
            next_at += {INTERVAL_S}
            time.sleep(max(0.0, next_at - time.monotonic()))
        print(json.dumps([(time.process_time() - cpu0) / (time.monotonic() - wall0), statistics.median(times)]))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    share, median = json.loads(out.stdout)
    return share, median


class Pty:
    """kvtop in a pseudo-terminal; a thread drains the screen output so kvtop never blocks on it."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.text = b""
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self.master], [], [], 0.1)
                if ready:
                    chunk = os.read(self.master, 65536)
                    if not chunk:
                        return
                    with self.lock:
                        self.text = (self.text + ANSI.sub(b"", chunk))[-200_000:]
            except OSError:
                return

    def wait_for(self, needles: list[bytes], timeout: float) -> float:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(n in self.text for n in needles):
                    return time.monotonic() - self.started
            if self.proc.poll() is not None:
                break
            time.sleep(0.005)
        raise RuntimeError(f"kvtop never showed {needles!r}; last output: {self.text[-2000:]!r}")

    def close(self) -> None:
        try:
            os.write(self.master, b"q")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _kvtop_cpu(env: dict[str, str], seconds: float) -> tuple[float, float]:
    """(seconds to the first frame, kvtop's CPU share of one core at 4 refreshes a second)."""
    import psutil

    term = Pty([*_kvtop(), "--interval", str(INTERVAL_S)], env)
    try:
        first = term.wait_for([b"bench-15", b"page map \xc2\xb7 bench-00"], timeout=60)
        time.sleep(2.0)  # settle: the first frames fill the history and the table
        proc = psutil.Process(term.proc.pid)
        cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        share = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0)
    finally:
        term.close()
    return first, share


def run(quick: bool) -> list[dict]:
    seconds = 5.0 if quick else 30.0
    with tempfile.TemporaryDirectory(prefix="kvtop-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as tmp:
        env = _env(Path(tmp))
        fleet = _start_fleet(env)
        try:
            reads_share, read_s = _reads_alone(env, seconds)
            first, kvtop_share = _kvtop_cpu(env, seconds)
        finally:
            fleet.kill()
            fleet.wait()
            for leftover in Path(tmp).glob("kvc.*"):
                leftover.unlink()
    fleet_note = f"{MODELS} models x {PAGES:,} pages (host backend, live traffic), {COLS}x{ROWS} terminal"
    cores = os.cpu_count() or 1
    return [
        {"name": "kvtop_first_frame", "value": round(first, 3), "unit": "s",
         "note": f"spawn to the fleet on screen in a pty; {fleet_note}"},
        {"name": "kvtop_cpu", "value": round(kvtop_share * 100, 2), "unit": "% of one core",
         "note": f"kvtop at {1 / INTERVAL_S:g} refreshes/s over {seconds:g} s; target <= 10; "
                 f"{fleet_note}; {cores} cores on this host, shared with the fleet's own threads"},
        {"name": "kvtop_snapshot_reads_cpu", "value": round(reads_share * 100, 2), "unit": "% of one core",
         "note": f"LiveSource.read alone at {1 / INTERVAL_S:g}/s (scan of {MODELS} + one {PAGES:,}-page map), "
                 "nothing drawn"},
        {"name": "kvtop_snapshot_read", "value": round(read_s * 1000, 3), "unit": "ms",
         "note": "median of one LiveSource.read"},
    ]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row))
