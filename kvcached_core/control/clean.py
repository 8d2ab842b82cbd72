"""What dead processes left in the segment directory, and its verified removal (``kvctl clean``).

Only files of this user: stale segments whose writer is gone and whose heartbeat is late, half-created
segments (``.kvc-new.<name>.<pid>``) of a killed creator, upstream kvcached segments whose process group is
gone, and files another tool names with its pid (``owners``). Each leftover carries the check that made it
one; :meth:`Leftover.remove` runs it again on the open file and removes that inode only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..interop.legacy import dead_segment
from ..segment import layout as L
from ..segment.liveness import heartbeat_late, removable
from ..segment.procinfo import is_alive
from ..segment.reader import parse_header
from ..segment.removal import inode, remove_verified
from ..segment.snapshot import ModelSnapshot
from ..segment.writer import temp_owner
from ..settings import settings

Recheck = Callable[[int], bool]  # an open file descriptor -> still the dead thing it was found to be
Owner = Callable[[str], "int | None"]  # a file name -> the pid that owns it (None: not such a file)


@dataclass(frozen=True)
class Leftover:
    """A file a dead process left: where, what it was, its stat when found, and the check to repeat."""

    path: str
    detail: str
    stat: os.stat_result
    recheck: Recheck

    def remove(self) -> bool:
        """Remove it if the file there is still this inode and still passes its check (False: left as it is,
        replaced meanwhile). OSError when removal itself fails."""
        return remove_verified(self.path, inode(self.stat), self.recheck)


@dataclass(frozen=True)
class Found:
    """:func:`leftovers`' answer: what may go, and a line for each file kept that a person may wonder about."""

    leftovers: list[Leftover]
    kept: list[str]


def _dead_segment(m: ModelSnapshot) -> Recheck:
    """Whether an open file is still the segment of ``m``'s process (not a newer one's), and that writer is gone."""
    def check(fd: int) -> bool:
        body = os.pread(fd, L.PAGE_MAP_OFF, 0)
        header = parse_header(body)
        if (header["pid"], header["start_time"]) != (m.pid, m.start_time):
            return False  # replaced by a newer process since it was listed
        return removable(header, body)
    return check


def _still_dead(m: ModelSnapshot) -> os.stat_result | None:
    """The file's stat when the file now at ``m.path`` is still our segment of that same dead process."""
    try:
        fd = os.open(m.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return st if _dead_segment(m)(fd) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _dead_creator(pid: int) -> Recheck:
    return lambda fd: os.fstat(fd).st_uid == os.getuid() and not is_alive(pid, 0)


def _dead_owned_files(owner: Owner) -> list[tuple[str, int, os.stat_result]]:
    """Regular files of ours in the segment directory whose owning process (``owner`` reads its pid from the
    file name) is gone."""
    directory = settings().shm_dir
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for filename in names:
        pid = owner(filename)
        if pid is None or is_alive(pid, 0):
            continue
        path = str(directory / filename)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            found.append((path, pid, st))
    return found


def _stale_segment(m: ModelSnapshot, kept: list[str]) -> Leftover | None:
    if m.status != "stale":
        if m.late and m.uid == os.getuid():
            kept.append(f"kept {m.path}: process {m.pid} still runs (its heartbeat is late)")
        return None
    try:
        owner = os.lstat(m.path).st_uid
    except FileNotFoundError:
        return None  # went away on its own
    if owner != os.getuid():
        kept.append(f"kept {m.path}: it belongs to uid {owner}, not you")
        return None
    if m.legacy:
        dead = dead_segment(Path(m.path))
        if dead is None:
            return None
        return Leftover(m.path, f"upstream kvcached segment, process group {m.pid} gone", *dead)
    if not heartbeat_late(m.heartbeat_ns, m.read_ns):
        kept.append(f"kept {m.path}: process {m.pid} is gone but its heartbeat is fresh; "
                    "run kvctl clean again in a few seconds")
        return None
    checked = _still_dead(m)
    if checked is None:
        return None
    return Leftover(m.path, f"model {m.model}, pid {m.pid}", checked, _dead_segment(m))


def leftovers(models: Iterable[ModelSnapshot], owners: Sequence[tuple[Owner, str]] = ()) -> Found:
    """The leftovers among ``models`` (a scan of the segment directory) and the half-created segments beside
    them; ``owners``: (reads a pid from a file name, what such a file is) for other files of dead processes."""
    kept: list[str] = []
    found = [x for m in models if (x := _stale_segment(m, kept)) is not None]
    found += [Leftover(path, f"a segment pid {pid} never finished creating", st, _dead_creator(pid))
              for path, pid, st in _dead_owned_files(temp_owner)]
    for owner, what in owners:
        found += [Leftover(path, f"{what}, pid {pid} gone", st, _dead_creator(pid))
                  for path, pid, st in _dead_owned_files(owner)]
    return Found(found, kept)
