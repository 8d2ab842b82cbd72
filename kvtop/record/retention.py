"""``--max-size``: drop the oldest day files while the recording is larger, deleting only verified recordings.

Every delete here goes through one helper, :func:`_remove`: the name is opened without following a symbolic
link, the file held is checked (a regular file of this user, on the day file's file system, and for a day file a
recording), and only that inode is removed, through ``kvcached_core.control.remove_verified`` (moved
to a private name, checked again there, then unlinked; a file swapped in meanwhile is put back, never deleted).
A day file's WAL and shared-memory files go with it; one that is not ours to delete is left and named in one
line (``report``, stderr by default).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from kvcached_core.control import inode, remove_verified
from kvtop.record.schema import APPLICATION_ID, day_files

SQLITE_MAGIC = b"SQLite format 3\x00"
SIDECARS = ("-wal", "-shm")
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

Check = Callable[[int], str]  # an open file descriptor -> why it is not the file to delete ("" when it is)
Report = Callable[[str], None]


def recording_size(path: Path) -> int:
    """A day file's bytes with its WAL."""
    total = 0
    for p in (str(path), f"{path}-wal"):
        with contextlib.suppress(OSError):
            total += os.lstat(p).st_size
    return total


def _stderr(line: str) -> None:
    print(f"kvctl: warning: {line}", file=sys.stderr)


def _not_ours(st: os.stat_result, device: int | None) -> str:
    """Why a file is not ours to delete ("" when it is): a regular file of this user, on ``device`` when given."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if device is not None and st.st_dev != device:
        return "on another file system than its day file"
    return ""


def _not_recording(fd: int) -> str:
    """Why an open file is not a recording ("" when it is): SQLite with the recording's application id."""
    head = os.pread(fd, 100, 0)
    if len(head) < 72 or not head.startswith(SQLITE_MAGIC):
        return "not an SQLite file"
    if int.from_bytes(head[68:72], "big") != APPLICATION_ID:
        return "not a recording (another application id)"
    return ""


def _remove(path: Path, device: int | None, check: Check | None = None) -> tuple[os.stat_result | None, str]:
    """Remove the file ``path`` names only if, opened unfollowed, it is ours (:func:`_not_ours`) and passes
    ``check``, and only that inode. Returns (its stat, "") when removed, (None, "") when there is no such file,
    else (None, why it was left)."""
    try:
        fd = os.open(path, _OPEN)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symbolic link, not followed"
        return None, f"cannot open: {exc.strerror or exc}"

    def why(held: int) -> str:
        return _not_ours(os.fstat(held), device) or (check(held) if check is not None else "")

    try:
        st = os.fstat(fd)
        reason = why(fd)
    except OSError as exc:
        reason = f"cannot read: {exc.strerror or exc}"
    finally:
        os.close(fd)
    if reason:
        return None, reason
    try:
        if remove_verified(path, inode(st), lambda held: not why(held)):
            return st, ""
    except OSError as exc:  # not ours to rename, or RemovalConflict (which says where the file is kept)
        return None, f"cannot remove: {exc.strerror or exc}"
    return None, "replaced while it was being removed; the file there now is left"


def _unlink_if_recording(path: Path, report: Report) -> bool:
    """Remove the day file ``path`` if it is a verified recording of ours, then its WAL and shared-memory files
    if each is ours; a side file left is reported. False: the day file is left alone (not reported: it is not
    a recording of ours)."""
    st, _ = _remove(path, None, _not_recording)
    if st is None:
        return False
    for suffix in SIDECARS:
        side = Path(f"{path}{suffix}")
        _, why = _remove(side, st.st_dev)
        if why:
            report(f"{side}: not deleted with {path.name}: {why}")
    return True


def drop_oldest(directory: Path, max_size: int, keep: Path | None = None, report: Report = _stderr) -> list[Path]:
    """Drop day files, oldest first, while the directory's recording exceeds ``max_size`` bytes; never ``keep``
    (the file being written) and never a file that is not a recording. Returns the files dropped; a side file
    left (not ours, a symbolic link, replaced meanwhile) is one line to ``report``."""
    files = [p for p in day_files(directory) if keep is None or p.name != keep.name]
    total = sum(recording_size(p) for p in files) + (recording_size(keep) if keep is not None else 0)
    dropped = []
    for path in files:
        if total <= max_size:
            break
        size = recording_size(path)
        if _unlink_if_recording(path, report):
            dropped.append(path)
            total -= size
    return dropped
