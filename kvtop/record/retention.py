"""``--max-size``: drop the oldest day files while the recording is larger, deleting only verified recordings."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from kvtop.record.schema import APPLICATION_ID, day_files

SQLITE_MAGIC = b"SQLite format 3\x00"
SIDECARS = ("-wal", "-shm")


def recording_size(path: Path) -> int:
    """A day file's bytes with its WAL."""
    total = 0
    for p in (str(path), f"{path}-wal"):
        with contextlib.suppress(OSError):
            total += os.lstat(p).st_size
    return total


def _unlink_if_recording(path: Path) -> bool:
    """Remove ``path`` only if the file opened is a regular SQLite file with the recording's application id and
    the name still points at that same inode; its WAL and shared-memory files go with it. False: left alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 100, 0)
        if not stat.S_ISREG(st.st_mode) or len(head) < 72 or not head.startswith(SQLITE_MAGIC):
            return False
        if int.from_bytes(head[68:72], "big") != APPLICATION_ID:
            return False
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
    except OSError:
        return False
    finally:
        os.close(fd)
    for suffix in SIDECARS:
        side = Path(f"{path}{suffix}")
        try:
            if stat.S_ISREG(os.lstat(side).st_mode):
                os.unlink(side)
        except OSError:
            pass
    return True


def drop_oldest(directory: Path, max_size: int, keep: Path | None = None) -> list[Path]:
    """Drop day files, oldest first, while the directory's recording exceeds ``max_size`` bytes; never ``keep``
    (the file being written) and never a file that is not a recording. Returns the files dropped."""
    files = [p for p in day_files(directory) if keep is None or p.name != keep.name]
    total = sum(recording_size(p) for p in files) + (recording_size(keep) if keep is not None else 0)
    dropped = []
    for path in files:
        if total <= max_size:
            break
        size = recording_size(path)
        if _unlink_if_recording(path):
            dropped.append(path)
            total -= size
    return dropped
