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


# -- the records: each written here and nowhere else ---------------------------------------------------------
# One record is payload words, then the check that ties them to the new revision, then the revision word last:
# the allocator takes a record whose check matches, so one half-written (a writer killed between its stores)
# is never taken, and the next numbers on from the last whole one. Call these under the controllers' lock
# (``write_request`` / ``write_without_waiting``): they read the last revision and write the next.

def write_limit(mm: mmap.mmap, limit_bytes: int | None) -> int:
    """A limit request (None: no limit); its revision."""
    revision = L.U64.unpack_from(mm, L.LIMIT_REV_OFF)[0] + 1
    value = -1 if limit_bytes is None else limit_bytes
    L.I64.pack_into(mm, L.LIMIT_OFF, value)
    L.U64.pack_into(mm, L.LIMIT_CHECK_OFF, L.limit_check(value, revision))
    L.U64.pack_into(mm, L.LIMIT_REV_OFF, revision)
    return revision


def write_sleep(mm: mmap.mmap, action: int, idle_ms: int) -> int:
    """A sleep request (``layout.SLEEP_*`` action, after-idle policy in ms); its revision."""
    revision = L.U64.unpack_from(mm, L.SLEEP_CTL_OFF)[0] + 1
    if revision > L.MAX_SLEEP_REVISION:  # a damaged word: start again (the allocator takes any revision but its last)
        revision = 1
    L.U64.pack_into(mm, L.SLEEP_CTL_OFF + 8, action)
    L.I64.pack_into(mm, L.SLEEP_CTL_OFF + 16, idle_ms)
    L.U64.pack_into(mm, L.SLEEP_CTL_OFF + 24, L.sleep_check(action, idle_ms, revision))
    L.U64.pack_into(mm, L.SLEEP_CTL_OFF, revision)
    return revision


def write_policy(mm: mmap.mmap, raw_min: int, raw_priority: int) -> int:
    """A policy request (``layout.POLICY_*_KEEP`` / ``POLICY_MIN_NONE`` for what it leaves or removes); its
    revision."""
    revision = L.U64.unpack_from(mm, L.POLICY_CTL_OFF)[0] + 1
    L.I64.pack_into(mm, L.POLICY_CTL_OFF + 8, raw_min)
    L.I64.pack_into(mm, L.POLICY_CTL_OFF + 16, raw_priority)
    L.U64.pack_into(mm, L.POLICY_CTL_OFF + 24, L.policy_check(revision, raw_min, raw_priority))
    L.U64.pack_into(mm, L.POLICY_CTL_OFF, revision)
    return revision


def write_reclaim(mm: mmap.mmap, want: int, asker: int, acked_seq: int) -> int:
    """Another model's reclaim request for ``want`` bytes; its sequence number, or 0 when one is still
    outstanding (its sequence past ``acked_seq``, the donor's last answer): one request per donor at a time."""
    seq = L.U64.unpack_from(mm, L.RECLAIM_CTL_OFF)[0]
    if seq > acked_seq:
        return 0
    seq += 1
    L.U64.pack_into(mm, L.RECLAIM_CTL_OFF + 8, want)
    L.U64.pack_into(mm, L.RECLAIM_CTL_OFF + 16, asker)
    L.U64.pack_into(mm, L.RECLAIM_CTL_OFF + 24, L.reclaim_check(seq, want, asker))
    L.U64.pack_into(mm, L.RECLAIM_CTL_OFF, seq)
    return seq


def next_sequence(mm: mmap.mmap, offset: int) -> int:
    """A sequence-numbered request (trim at ``layout.TRIM_REQ_OFF``, compact at ``COMPACT_REQ_OFF``): one
    more than the last; the new number."""
    seq = L.U64.unpack_from(mm, offset)[0] + 1
    L.U64.pack_into(mm, offset, seq)
    return seq
