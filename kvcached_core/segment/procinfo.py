"""Process identity: a pid plus its start time names one process, even after pid reuse."""

from __future__ import annotations

import os

MAX_PID = 2**22  # the kernel's ceiling (pid_max); larger values come from a damaged header


def stat_fields(pid: int | str) -> list[bytes]:
    """Fields 3.. of /proc/PID/stat (state first); [] if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return []
    # The command name may hold spaces and parentheses: split after the last ')'.
    return data[data.rfind(b")") + 2:].split()


def start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat); 0 if unknown."""
    rest = stat_fields(pid)
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return 0


def _uids(pid: int) -> tuple[int, ...]:
    """The real, effective, saved and file-system uids of ``pid`` (/proc/PID/status); () if unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Uid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def is_alive(pid: int, started: int, uid: int | None = None) -> bool:
    """True when ``pid`` runs and is the same process that started at ``started`` (0: any start time).

    With ``uid``, the process must also run as that user (real or effective uid): a file that
    names someone else's process (pid 1, say) does not borrow its life.
    """
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    rest = stat_fields(pid)
    if rest[:1] in ([b"Z"], [b"X"]):
        return False  # exited, not yet reaped by its parent: a crash looks like this until then
    if uid is not None and uid not in _uids(pid)[:2]:
        return False
    if started == 0:
        return True
    try:
        return int(rest[19]) == started
    except (IndexError, ValueError):
        return False
