"""Verified deletes: remove the inode that was checked, never whatever a path names a moment later.

``remove_verified`` renames the file to a private hidden name in the same directory first (one
atomic step; in a sticky directory such as /dev/shm only the file's owner may), then checks the
file it now holds under that name, where nothing else can be swapped in, and only then unlinks
it. A file that turns out not to be the one checked is put back under its name, never over a
file that appeared there meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

REMOVING_PREFIX = ".kvc-del."  # a file between its rename and its unlink: REMOVING_PREFIX + pid + token
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100

_renameat2: Any  # libc's renameat2, or None where libc lacks it
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    _renameat2.restype = ctypes.c_int
except (OSError, AttributeError):  # an old libc: fall back to link + unlink, which never replaces either
    _renameat2 = None


class RemovalConflict(OSError):
    """The file was not ours to remove and its name was taken again before it could be put back."""


def inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _rename_noreplace(src: str, dst: str) -> None:
    """rename(2) that fails with FileExistsError instead of replacing ``dst``."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: a file system without the flag
            raise OSError(code, os.strerror(code), dst)
    os.link(src, dst, follow_symlinks=False)
    os.unlink(src)


def _holds(private: str, expected: tuple[int, int], check: Callable[[int], bool] | None) -> bool:
    """Whether the file now under ``private`` is the expected regular file and passes ``check``."""
    try:
        fd = os.open(private, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # a symbolic link, a FIFO nobody writes, ...: not the file we checked
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or inode(st) != expected:
            return False
        return check is None or bool(check(fd))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def remove_verified(path: str | os.PathLike[str], expected: tuple[int, int],
                    check: Callable[[int], bool] | None = None) -> bool:
    """Remove ``path`` only while it is the file ``expected`` ((st_dev, st_ino)) and ``check(fd)`` holds.

    ``check`` gets a read-only descriptor of the file as it is held privately. Returns True when
    removed, False when ``path`` is gone or holds another file (which is left as it was). Raises
    OSError when the file cannot be renamed (not ours), RemovalConflict in the rare case where a
    file that was not ours cannot be put back because its name was taken again meanwhile.
    """
    path = os.fspath(path)
    try:
        if inode(os.lstat(path)) != expected:
            return False  # the common case of a replaced file: never moved at all
    except FileNotFoundError:
        return False
    private = str(Path(path).with_name(f"{REMOVING_PREFIX}{os.getpid()}.{secrets.token_hex(6)}"))
    try:
        _rename_noreplace(path, private)
    except FileNotFoundError:
        return False
    if _holds(private, expected, check):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private)
        return True
    try:
        _rename_noreplace(private, path)
    except FileExistsError:
        raise RemovalConflict(errno.EEXIST, f"{path} was replaced twice while it was being removed; "
                                            f"the file that was there is kept as {private}") from None
    return False
