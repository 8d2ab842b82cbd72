"""Helpers the benchmark modules share: percentiles, a private segment directory, child
processes, and the upstream kvcached status path we compare against.

The upstream path is implemented here, not imported: upstream keeps three little-endian int64
(total/limit, used, prealloc) in a 24-byte shared-memory file, and every status update or
limit check opens the file, takes a flock, maps it, reads or writes, unmaps and closes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGACY = struct.Struct("<qqq")  # total (limit), used, prealloc


def vllm_python() -> str | None:
    """A Python that imports vLLM: this one, or the README's .venv-vllm; None when neither does."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[rank]


def summary_us(ns: Sequence[int]) -> dict[str, float]:
    """p50 / p99 / p99.9 / max in microseconds from nanosecond samples."""
    values = sorted(ns)
    return {q: percentile(values, float(q[1:])) / 1e3 for q in ("p50", "p99", "p99.9")} | {"max": values[-1] / 1e3}


def shm_base() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@contextlib.contextmanager
def private_segments(**settings: str) -> Iterator[Path]:
    """A fresh KVCACHED_SHM_DIR (plus any other settings) for the duration; restored afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="kvc-bench-", dir=shm_base()))
    settings = {"KVCACHED_SHM_DIR": str(directory), **settings}
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield directory
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(directory, ignore_errors=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def spawn(code: str) -> subprocess.Popen:
    """Run ``code`` in a child Python with line-buffered pipes; the child prints READY when set up."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=child_env(), text=True, bufsize=1)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"benchmark child failed to start: {line!r}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# -- the upstream status path -------------------------------------------------------------------
def legacy_create(path: Path, total: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, LEGACY.pack(total, 0, 0))
    finally:
        os.close(fd)


def legacy_publish(path: Path, used: int, prealloc: int) -> None:
    """Upstream's update_memory_usage: open, flock (exclusive), mmap, read-modify-write, unmap, close."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with mmap.mmap(fd, LEGACY.size) as mm:
                total = LEGACY.unpack_from(mm, 0)[0]
                LEGACY.pack_into(mm, 0, total, used, prealloc)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def legacy_read(path: Path) -> tuple[int, int, int]:
    """Upstream's readers (its kvtop, its limit watcher): open, shared flock, mmap, read, close."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            with mmap.mmap(fd, LEGACY.size, prot=mmap.PROT_READ) as mm:
                return LEGACY.unpack_from(mm, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def legacy_set_limit(path: Path, total: int) -> None:
    """Upstream's kvctl limit: rewrite the total field under an exclusive flock."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with mmap.mmap(fd, LEGACY.size) as mm:
                _total, used, prealloc = LEGACY.unpack_from(mm, 0)
                LEGACY.pack_into(mm, 0, total, used, prealloc)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def pair_ratios(runs: list[dict]) -> dict:
    """The ratios of a repeated comparison, pair by pair (the n-th static run against the n-th elastic one, as they
    were interleaved): p99 and mean TTFT static/elastic, throughput elastic/static and, where the runs give it, the
    mean decode time per output token static/elastic (above 1: elastic better), their median and range. ``runs``: every repeat in order, each with ``configuration`` (static or elastic),
    ``ttft_p99_s``, ``ttft_mean_s`` and ``tokens_per_s``."""
    static = [r for r in runs if r["configuration"] == "static"]
    elastic = [r for r in runs if r["configuration"] == "elastic"]
    ttft = [s["ttft_p99_s"] / e["ttft_p99_s"] for s, e in zip(static, elastic, strict=False) if e["ttft_p99_s"]]
    mean = [s["ttft_mean_s"] / e["ttft_mean_s"] for s, e in zip(static, elastic, strict=False) if e["ttft_mean_s"]]
    thr = [e["tokens_per_s"] / s["tokens_per_s"] for s, e in zip(static, elastic, strict=False) if s["tokens_per_s"]]
    tpot = [s["tpot_mean_s"] / e["tpot_mean_s"] for s, e in zip(static, elastic, strict=False)
            if s.get("tpot_mean_s") and e.get("tpot_mean_s")]

    def r(value: float) -> float:
        return round(value, 3)

    return {"ttft_p99_ratio_median": r(statistics.median(ttft)) if ttft else float("nan"),
            "ttft_p99_ratio_min": r(min(ttft)) if ttft else float("nan"),
            "ttft_p99_ratio_max": r(max(ttft)) if ttft else float("nan"),
            "ttft_mean_ratio_median": r(statistics.median(mean)) if mean else float("nan"),
            "throughput_ratio_median": r(statistics.median(thr)) if thr else float("nan"),
            "throughput_ratio_min": r(min(thr)) if thr else float("nan"),
            "throughput_ratio_max": r(max(thr)) if thr else float("nan"),
            **({"tpot_ratio_median": r(statistics.median(tpot)), "tpot_ratio_min": r(min(tpot)),
                "tpot_ratio_max": r(max(tpot))} if tpot else {})}
