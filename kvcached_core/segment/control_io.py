"""Writing another model's control words: open its segment for control, lock it, write one record.

Controllers (kvctl, kvtop, the exporter's callers) and allocators asking each other for memory
(:mod:`kvcached_core.allocator.pressure`) write only the segment's control blocks, serialised
among themselves by flock on the file; the segment's own allocator never takes that lock, so no
writer here can stall an engine. Only the file's owner may write it, and only an owner-only file.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

from . import layout as L


class ControlWriteError(RuntimeError):
    """The segment cannot be written as a control (not ours, not a regular file, readable by others)."""


def open_for_control(path: Path) -> tuple[int, mmap.mmap]:
    """``(fd, map of the segment's preamble)`` opened read-write, after the ownership checks."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ControlWriteError(f"cannot open {path.name} for writing: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ControlWriteError(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ControlWriteError(f"{path.name} belongs to uid {st.st_uid}, not you (uid {os.getuid()}); "
                                    "refusing to write it")
        if st.st_mode & 0o077:
            raise ControlWriteError(f"{path.name} is readable by others (mode {st.st_mode & 0o777:o}); "
                                    "refusing to trust it")
        if st.st_size < L.PAGE_MAP_OFF:
            raise ControlWriteError(f"{path.name} is too short to be a segment")
        mm = mmap.mmap(fd, L.PAGE_MAP_OFF, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def wake_token(mm: mmap.mmap) -> int:
    """The token that names the allocator's wake socket (0: nobody to poke)."""
    return int(dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(mm, 0), strict=True))["wake_token"])


def write_without_waiting(path: Path, write: Callable[[mmap.mmap], int]) -> tuple[int, int] | None:
    """Run ``write(mm)`` under the controllers' lock if it is free right now; ``(its result, the wake token)``,
    or None when another writer holds the lock (never waited on: an allocator's thread calls this)."""
    fd, mm = open_for_control(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        try:
            return write(mm), wake_token(mm)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        mm.close()
        os.close(fd)
