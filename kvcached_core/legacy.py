"""Upstream kvcached segments: 24 bytes (total/limit, used, prealloc as little-endian int64), flock-guarded.

We read them as ``legacy`` rows and write a limit into the total field, under flock, the way
upstream's watcher reads it, so kvcached users can switch tools without switching engines.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from . import layout as L
from .config import ipc_name_override
from .names import LEGACY_PREFIX
from .snapshot import ModelSnapshot

READ_LOCK_TIMEOUT_S = 0.1  # upstream holds its flock for microseconds; longer means a hung holder
WRITE_LOCK_TIMEOUT_S = 1.0


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
    return filename.startswith(LEGACY_PREFIX) or filename == ipc_name_override()


def _engine_and_pid(filename: str) -> tuple[str, int]:
    if filename.startswith(LEGACY_PREFIX):
        engine, _, pgid = filename[len(LEGACY_PREFIX):].rpartition("_")
        if pgid.isdigit():
            return engine or "kvcached", int(pgid)
    return "kvcached", 0


def read_legacy(path: Path) -> ModelSnapshot:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size != L.LEGACY_SIZE:
            raise ValueError(f"{st.st_size} bytes, not an upstream kvcached segment ({L.LEGACY_SIZE} bytes)")
        flock_within(fd, fcntl.LOCK_SH, READ_LOCK_TIMEOUT_S)
        try:
            raw = os.pread(fd, L.LEGACY_SIZE, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    total, used, prealloc = L.LEGACY.unpack(raw)
    engine, pgid = _engine_and_pid(path.name)
    return ModelSnapshot(
        name=path.name, path=str(path), model=path.name, engine=engine, backend="kvcached",
        pid=pgid, uid=st.st_uid, device=0, status="legacy", page_size=0, block_bytes=0,
        num_layers=0, num_kv_buffers=0, blocks_per_page=0, num_blocks=0, pages_total=0,
        pages_inuse=0, pages_reserved=0, blocks_used=0, blocks_cached=0,
        mapped_bytes=max(0, used) + max(0, prealloc),
        limit_bytes=total if total > 0 else None, limit_status="applied" if total > 0 else "none",
        legacy_reserved=max(0, prealloc),
    )


def write_legacy_limit(path: Path, limit_bytes: int) -> None:
    """Write the total field as upstream's watcher reads it. Refuses files we do not own."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}; refusing to write it")
        if not stat.S_ISREG(st.st_mode) or st.st_size != L.LEGACY_SIZE:
            raise ValueError(f"{path} is not an upstream kvcached segment")
        flock_within(fd, fcntl.LOCK_EX, WRITE_LOCK_TIMEOUT_S)
        try:
            os.pwrite(fd, L.I64.pack(limit_bytes), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
