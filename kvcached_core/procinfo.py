"""Process identity: a pid plus its start time names one process, even after pid reuse."""

from __future__ import annotations

import os

MAX_PID = 2**22  # the kernel's ceiling (pid_max); larger values come from a damaged header


def _stat_fields(pid: int) -> list[bytes]:
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
    rest = _stat_fields(pid)
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return 0


def is_alive(pid: int, started: int) -> bool:
    """True when ``pid`` runs and is the same process that started at ``started``."""
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    rest = _stat_fields(pid)
    if rest[:1] in ([b"Z"], [b"X"]):
        return False  # exited, not yet reaped by its parent: a crash looks like this until then
    if started == 0:
        return True
    try:
        return int(rest[19]) == started
    except (IndexError, ValueError):
        return False
