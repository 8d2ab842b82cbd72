"""The router's per-model figures where kvctl list/show --json and the exporter read them: one small file per
router in the segment directory, ``.kvroute.<pid>`` (hidden: segment scans pass it by).

The router writes it (owner-only, 0600, created under a temporary name and renamed into place, so a
reader never sees half of it) about once a second and removes it when it stops. A reader takes a file
only when it is a regular file this user owns and keeps private, at most :data:`MAX_BYTES`, whose JSON
has exactly the shape written here with values that can be (counts from 0 to 2^53, seconds from 0 to a
day or null), and whose writer still runs (pid and start time): a file that fails the first checks is
reported as not trusted, one whose router has exited is passed by.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from kvcached_core import process_start_time as start_time

PREFIX = ".kvroute."
VERSION = 1
MAX_BYTES = 1 << 20
COUNTS = ("requests", "errors", "in_flight", "woken")
SECONDS = ("ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s")
MAX_COUNT = 1 << 53
MAX_SECONDS = 86_400.0


def path_of(directory: Path, pid: int) -> Path:
    return directory / f"{PREFIX}{pid}"


def write(directory: Path, listen: str, models: dict[str, dict]) -> None:
    """Publish ``models`` (segment name -> :meth:`ModelFigures.to_dict`) for this process's router."""
    pid = os.getpid()
    body = json.dumps({"version": VERSION, "pid": pid, "start_time": start_time(pid), "listen": listen,
                       "written_ns": time.time_ns(), "models": models}).encode()
    tmp = directory / f"{PREFIX}{pid}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, body)
    finally:
        os.close(fd)
    os.replace(tmp, path_of(directory, pid))


def remove(directory: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path_of(directory, os.getpid()))


@dataclass(frozen=True)
class Published:
    """What the routers running on this host publish: figures by segment name, and the files not trusted."""

    models: dict[str, dict]
    untrusted: tuple[tuple[str, str], ...]  # (path, why)


def _problem(data: object, pid: int) -> str | None:
    """Why ``data`` is not what a router writes; None when it is."""
    if not isinstance(data, dict) or set(data) != {"version", "pid", "start_time", "listen", "written_ns", "models"}:
        return "not the router's record"
    if data["version"] != VERSION or data["pid"] != pid or not isinstance(data["start_time"], int):
        return "a version, pid or start time no router of this version writes"
    if not isinstance(data["listen"], str) or not isinstance(data["models"], dict):
        return "not the router's record"
    for name, figures in data["models"].items():
        if not isinstance(name, str) or not isinstance(figures, dict) or set(figures) != {*COUNTS, *SECONDS}:
            return f"model {name!r}: not the router's figures"
        for key in COUNTS:
            value = figures[key]
            if type(value) is not int or not 0 <= value <= MAX_COUNT:
                return f"model {name!r}: {key} {value!r} cannot be"
        for key in SECONDS:
            value = figures[key]
            if value is not None and (type(value) not in (int, float) or not 0 <= value <= MAX_SECONDS):
                return f"model {name!r}: {key} {value!r} cannot be"
    return None


def read(directory: Path) -> Published:
    """Every running router's figures in ``directory``; a model two routers serve shows the busier one's."""
    models: dict[str, dict] = {}
    untrusted: list[tuple[str, str]] = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())
    except OSError:
        return Published({}, ())
    for name in names:
        path = str(directory / name)
        pid = int(name[len(PREFIX):])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                untrusted.append((path, exc.strerror or str(exc)))
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                untrusted.append((path, "not a private file of this user"))
                continue
            if st.st_size > MAX_BYTES:
                untrusted.append((path, f"{st.st_size} bytes: more than a router writes"))
                continue
            raw = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            data = json.loads(raw)
        except ValueError:
            untrusted.append((path, "not JSON"))
            continue
        why = _problem(data, pid)
        if why is not None:
            untrusted.append((path, why))
            continue
        if not data["start_time"] or start_time(pid) != data["start_time"]:
            continue  # its router has exited (a killed one leaves its file behind)
        for model, figures in data["models"].items():
            if model not in models or figures["requests"] > models[model]["requests"]:
                models[model] = figures
    return Published(models, tuple(untrusted))


def summary(figures: dict) -> str:
    """One line of a model's router figures, as kvctl show and kvtop's details say them."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    return (f"{figures['requests']:,} requests, {figures['errors']:,} errors, {figures['in_flight']} in flight, "
            f"{figures['woken']:,} woke it; TTFT p50/p99 {ms(figures['ttft_p50_s'])}/{ms(figures['ttft_p99_s'])} ms, "
            f"latency {ms(figures['latency_p50_s'])}/{ms(figures['latency_p99_s'])} ms")
