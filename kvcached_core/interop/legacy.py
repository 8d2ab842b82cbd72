"""Upstream kvcached segments: 24 bytes (total/limit, used, prealloc as little-endian int64), flock-guarded.

We read them as legacy rows and write a limit into the total field, under flock, the way
upstream's watcher reads it, so kvcached users can switch tools without switching engines.
A file is taken for one by its struct, as the public tools do: exactly 24 bytes whose three
fields are byte counts. Its name, when upstream chose it (``kvcached_<engine>_<pgid>``, then
an optional ``_<n>`` and ``_g<group>``), carries the process group that liveness is judged by;
a name set with ``KVCACHED_IPC_NAME`` carries none, and then liveness is unknown.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..backends import nvml
from ..segment import layout as L
from ..segment.names import LEGACY_PREFIX
from ..segment.pgroups import GroupJudge
from ..segment.snapshot import ModelSnapshot, Problem
from ..settings import settings
from ..sizes import format_bytes

READ_LOCK_TIMEOUT_S = 0.1  # upstream holds its flock for microseconds; longer means a hung holder
WRITE_LOCK_TIMEOUT_S = 1.0
MAX_FIELD_BYTES = 1 << 50  # 1 PiB, past any device: a larger field is not one of upstream's byte counts
ASSUMED_DEVICE = 0  # the struct does not say its device; the public kvctl assumes device 0 too
_UPSTREAM_NAME = re.compile(r"kvcached_(?P<engine>[A-Za-z0-9-]+)_(?P<pgid>[0-9]{1,10})(?:_[0-9]+)?(?:_g[0-9]+)?")


class NotLegacy(ValueError):
    """A file that does not parse as an upstream kvcached segment."""


class NoDeviceTotal(ValueError):
    """A percentage limit for an upstream segment, on a host where NVML cannot tell device 0's memory."""


def percent_base() -> tuple[int, str]:
    """What a percentage limit of an upstream segment is taken of: device 0's memory total by NVML,
    and the line that says so; NoDeviceTotal (with NVML's reason) when NVML cannot tell it."""
    gpus = nvml.probe([ASSUMED_DEVICE])
    total = gpus[0].total_bytes if gpus else None
    if not total:
        why = nvml.unavailable_reason() or f"NVML reports no memory total for device {ASSUMED_DEVICE}"
        raise NoDeviceTotal(f"a percentage needs the device's memory total, and NVML cannot tell it ({why}): "
                            "give bytes instead")
    return total, (f"of device {ASSUMED_DEVICE}'s {format_bytes(total)} (NVML; an upstream kvcached segment "
                   f"does not say its device, so device {ASSUMED_DEVICE} is assumed)")


def flock_within(fd: int, operation: int, timeout: float) -> None:
    """flock ``fd``, raising BlockingIOError after ``timeout`` s: a hung lock holder must never hang us."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise BlockingIOError(f"locked by another process for more than {timeout:g} s") from None
            time.sleep(0.001)


def is_legacy_name(filename: str) -> bool:
    """A name upstream gives its segments: ``kvcached_...`` or this process's ``KVCACHED_IPC_NAME``."""
    return filename.startswith(LEGACY_PREFIX) or filename == settings().ipc_name


def parse_name(filename: str) -> tuple[str, int]:
    """(engine, process group id) from ``kvcached_<engine>_<pgid>[_<n>][_g<group>]``; ("kvcached", 0) otherwise."""
    match = _UPSTREAM_NAME.fullmatch(filename)
    if match is None:
        return "kvcached", 0
    return match["engine"], int(match["pgid"])


def doubt(fields: tuple[int, int, int], *, named: bool) -> str | None:
    """Why three int64 are not an upstream segment's (total, used, prealloc); None when they are.

    A file without one of upstream's names must also have a positive total, as the public
    tools ask before they list a file.
    """
    for label, value in zip(("total", "used", "prealloc"), fields, strict=True):
        if not 0 <= value <= MAX_FIELD_BYTES:
            return f"its {label} field {value} is not a byte count"
    if not named and fields[0] == 0:
        return "its total field is 0 (the public kvctl skips such files too)"
    return None


def limit_refusal(name: str, limit_bytes: int | None) -> str | None:
    """Why a limit cannot be written to upstream segment ``name``; None when it can.

    Upstream has no "no limit": its watcher resizes the KV cache to the total field, so 0 would
    shrink that engine's cache to nothing (and hide it from the public kvctl).
    """
    if limit_bytes is None:
        return f"{name} is an upstream kvcached segment, which has no 'no limit': give it a size"
    if limit_bytes == 0:
        return (f"{name} is an upstream kvcached segment: a limit of 0 would empty its KV cache "
                "(and hide it from the public kvctl, which skips totals <= 0); give a positive size")
    return None


def limit_status(total: int, used: int) -> str:
    """``pending`` while more is in use than the limit (the engine applies it only as pages free), else ``written``.

    Upstream never acknowledges a limit, so neither is ever ``applied``.
    """
    return "pending" if used > total else "written"


def read_legacy(path: Path, *, named: bool = True, judge: GroupJudge | None = None) -> ModelSnapshot:
    """One upstream segment as a row; NotLegacy when the file is no such segment (see :func:`doubt`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotLegacy("not a regular file")
        if st.st_size != L.LEGACY_SIZE:
            raise NotLegacy(f"{st.st_size} bytes, not an upstream kvcached segment ({L.LEGACY_SIZE} bytes)")
        flock_within(fd, fcntl.LOCK_SH, READ_LOCK_TIMEOUT_S)
        try:
            raw = os.pread(fd, L.LEGACY_SIZE, 0)
            st = os.fstat(fd)  # its last write, now that no upstream writer is in the middle of one
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    if len(raw) != L.LEGACY_SIZE:
        raise NotLegacy("shrank while reading")
    total, used, prealloc = fields = L.LEGACY.unpack(raw)
    reason = doubt(fields, named=named)
    if reason is not None:
        raise NotLegacy(f"{L.LEGACY_SIZE} bytes like an upstream kvcached segment, but {reason}: not taken for one")
    engine, pgid = parse_name(path.name)
    verdict = (judge or GroupJudge()).verdict(pgid, st.st_mtime_ns) if pgid else "unknown"
    dead = verdict in ("gone", "reused")
    return ModelSnapshot(
        name=path.name, path=str(path), model=path.name, engine=engine, backend="kvcached",
        pid=pgid, uid=st.st_uid, device=ASSUMED_DEVICE, status="stale" if dead else "legacy", page_size=0, block_bytes=0,
        num_layers=0, num_kv_buffers=0, blocks_per_page=0, num_blocks=0, pages_total=0,
        pages_inuse=0, pages_reserved=0, blocks_used=0, blocks_cached=0,
        mapped_bytes=used + prealloc, limit_bytes=total,
        limit_status="stale" if dead else limit_status(total, used),
        updated_ns=st.st_mtime_ns, legacy_reserved=prealloc, legacy=True,
    )


def write_legacy_limit(path: Path, limit_bytes: int) -> tuple[int, int, int]:
    """Write the total field as upstream's watcher reads it; return the fields as written.

    Refuses files we do not own and files that no longer parse as an upstream segment.
    """
    if not 0 < limit_bytes <= MAX_FIELD_BYTES:
        raise ValueError(f"a limit of {limit_bytes} bytes is not one upstream can take")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}; refusing to write it")
        if not stat.S_ISREG(st.st_mode) or st.st_size != L.LEGACY_SIZE:
            raise ValueError(f"{path} is not an upstream kvcached segment")
        flock_within(fd, fcntl.LOCK_EX, WRITE_LOCK_TIMEOUT_S)
        try:
            raw = os.pread(fd, L.LEGACY_SIZE, 0)
            fields = L.LEGACY.unpack(raw) if len(raw) == L.LEGACY_SIZE else (-1, -1, -1)
            reason = doubt(fields, named=True)
            if reason is not None:
                raise ValueError(f"{path} no longer parses as an upstream kvcached segment ({reason})")
            os.pwrite(fd, L.I64.pack(limit_bytes), 0)
            return limit_bytes, fields[1], fields[2]
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _dead_fd(fd: int, pgid: int) -> bool:
    """Whether ``fd`` is our own upstream segment whose writer's process group ``pgid`` is gone or reused."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != L.LEGACY_SIZE:
        return False
    try:
        flock_within(fd, fcntl.LOCK_SH, READ_LOCK_TIMEOUT_S)  # someone holds it: someone still uses it
    except BlockingIOError:
        return False
    try:
        raw = os.pread(fd, L.LEGACY_SIZE, 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    if len(raw) != L.LEGACY_SIZE or doubt(L.LEGACY.unpack(raw), named=True) is not None:
        return False
    return GroupJudge().verdict(pgid, st.st_mtime_ns) in ("gone", "reused")


def dead_segment(path: Path) -> tuple[os.stat_result, Callable[[int], bool]] | None:
    """For ``kvctl clean``: the stat of ``path`` and the re-check to make on it once held privately,
    while it is our own upstream segment whose process group is gone; None otherwise.

    Only a file that parses as the struct and whose name carries a process group qualifies.
    """
    _, pgid = parse_name(path.name)
    if not pgid:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return (os.fstat(fd), lambda held: _dead_fd(held, pgid)) if _dead_fd(fd, pgid) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def upstream_row(filename: str, path: str, judge: GroupJudge) -> ModelSnapshot | Problem | None:
    """A file of the segment directory that is not one of ours, read as an upstream segment where it is a
    candidate (an upstream name, or exactly the struct's size): its row, a Problem, or None (no candidate,
    or removed while listed). The reader's ``foreign`` hook (``kvcached_core.fleet``)."""
    named = is_legacy_name(filename)
    if not (named or _struct_sized(path)):
        return None
    try:
        return _printable(read_legacy(Path(path), named=named, judge=judge))
    except FileNotFoundError:
        return None
    except BlockingIOError as exc:
        return Problem(path, "busy", str(exc))
    except NotLegacy as exc:
        return Problem(path, "foreign", str(exc))
    except (OSError, ValueError) as exc:
        return Problem(path, "unreadable" if isinstance(exc, OSError) else "foreign", str(exc))


def _struct_sized(path: str) -> bool:
    """A regular file of exactly upstream's struct size: a candidate whatever its name (upstream's test)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == L.LEGACY_SIZE


def _printable(m: ModelSnapshot) -> ModelSnapshot:
    """Upstream rows are named after their file: a file name's control characters never reach a terminal."""
    shown = (L.printable(m.name), L.printable(m.model), L.printable(m.engine))
    return m if shown == (m.name, m.model, m.engine) else replace(m, name=shown[0], model=shown[1], engine=shown[2])
