"""kvctl's cost as a user pays it: whole processes, timed from spawn to exit.

* startup: ``kvctl list --json`` over an empty segment directory, as a ratio to
  ``python -c "import click"`` measured in the same run, interleaved (the order rotates every
  round), medians. The goal is about 1x: kvctl should cost little more than importing click.
* 64 models: ``kvctl list --all --json`` over 64 segments of real KVCacheManagers (host backend,
  one helper child process), end to end; plus ``scan()`` of the same 64 segments in process.
  The helper is paused (SIGSTOP) while timing, so the figure is the reader's cost and not the
  64 allocators' background threads competing for the CPU; the rows then turn stale after
  3 s, which is why ``--all`` is passed; the reader does the same work either way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = 64


def _kvctl() -> tuple[list[str], str]:
    script = Path(sys.executable).parent / "kvctl"
    if script.exists():
        return [str(script)], "the kvctl console script"
    return [sys.executable, "-m", "kvtop.cli"], "python -m kvtop.cli"


def _env(directory: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["KVCACHED_SHM_DIR"] = str(directory)
    env["KVCACHED_HOST_CAPACITY"] = "1GiB"
    env["KVCACHED_MIN_RESERVED_PAGES"] = "1"
    env["KVCACHED_MAX_RESERVED_PAGES"] = "2"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, bytes]:
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.decode(errors='replace')}")
    return elapsed, done.stdout


def _interleaved(cmds: dict[str, list[str]], env: dict[str, str], rounds: int) -> dict[str, list[float]]:
    """Run every command once per round, rotating the order; return all timings per command."""
    times: dict[str, list[float]] = {k: [] for k in cmds}
    keys = list(cmds)
    for _ in range(2):  # warm the page cache and the bytecode caches
        for key in keys:
            _timed(cmds[key], env)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(_timed(cmds[key], env)[0])
    return times


HELPER = textwrap.dedent("""
    import sys
    from kvcached_core import KVCacheManager
    models = []
    for i in range(int(sys.argv[1])):
        m = KVCacheManager(f"bench-{i:02d}", name=f"bench-{i:02d}", num_blocks=256, block_bytes=16384,
                           num_layers=2, page_size=65536, engine="bench")
        m.alloc(1 + i % 7)
        models.append(m)
    print("READY", flush=True)
    sys.stdin.read()
    for m in models:
        m.close()
""")


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def run(quick: bool) -> list[dict]:
    rounds = 7 if quick else 25
    kvctl, how = _kvctl()
    directory = Path(tempfile.mkdtemp(prefix="kvctl-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    env = _env(directory)
    rows: list[dict] = []
    try:
        cmds = {
            "pass": [sys.executable, "-c", "pass"],
            "click": [sys.executable, "-c", "import click"],
            "kvctl": [*kvctl, "list", "--json"],
        }
        t = _interleaved(cmds, env, rounds)
        ratio = statistics.median(t["kvctl"]) / statistics.median(t["click"])
        rows.append({
            "name": "kvctl list --json startup / python -c 'import click'", "value": round(ratio, 3), "unit": "x",
            "note": (f"medians of {rounds} interleaved runs, empty segment directory, {how}: kvctl "
                     f"{_ms(t['kvctl']):.1f} ms, import click {_ms(t['click']):.1f} ms, "
                     f"python -c pass {_ms(t['pass']):.1f} ms"),
        })

        helper = subprocess.Popen([sys.executable, "-c", HELPER, str(MODELS)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env)
        try:
            if helper.stdout.readline().strip() != b"READY":
                raise RuntimeError("the helper process could not create its models")
            helper.send_signal(signal.SIGSTOP)
            listing = [*kvctl, "list", "--all", "--json"]
            count = len(json.loads(_timed(listing, env)[1]))
            if count != MODELS:
                raise RuntimeError(f"kvctl listed {count} models, expected {MODELS}")
            t64 = _interleaved({"click": cmds["click"], "kvctl": listing}, env, rounds)
            rows.append({
                "name": f"kvctl list --all --json, {MODELS} models", "value": round(_ms(t64["kvctl"]), 1), "unit": "ms",
                "note": (f"end to end, median of {rounds}; {statistics.median(t64['kvctl']) / statistics.median(t64['click']):.2f}x "
                         f"python -c 'import click' ({_ms(t64['click']):.1f} ms) in the same run; {count} rows checked"),
            })
            rows.append(_scan_in_process(directory, rounds))
        finally:
            helper.send_signal(signal.SIGCONT)
            helper.stdin.close()
            try:
                helper.wait(30)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def _scan_in_process(directory: Path, rounds: int) -> dict:
    from kvcached_core import scan

    times = []
    found = 0
    for _ in range(rounds * 4):
        start = time.perf_counter()
        found = len(scan(directory=directory).models)
        times.append(time.perf_counter() - start)
    per_model_us = statistics.median(times) * 1e6 / max(1, found)
    return {"name": f"scan() of {MODELS} segments, in process", "value": round(_ms(times), 2), "unit": "ms",
            "note": f"median of {len(times)}; {per_model_us:.0f} µs per model; {found} models read"}


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
