"""Process identity: a pid plus its start time names one process, even after pid reuse."""

from __future__ import annotations

import os


def start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return 0
    # The command name may hold spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return 0


def is_alive(pid: int, started: int) -> bool:
    """True when ``pid`` runs and is the same process that started at ``started``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if started == 0:
        return True
    return start_time(pid) == started
