"""Process groups, for segments that name their writer by process group id (upstream kvcached's).

A verdict on group ``pgid`` and the moment its file was last written:

- ``alive``: the group exists in our pid namespace and is older than that write;
- ``reused``: a group of that id exists but was created after the write (the writer's is gone);
- ``gone``: no such group here;
- ``unknown``: instead of ``reused`` or ``gone`` when a process in a pid namespace nested in
  ours has that group id in its own namespace (a container's engine), or when we do not run in
  the initial pid namespace and so cannot see every process.
"""

from __future__ import annotations

import os
import time

from .procinfo import MAX_PID, stat_fields

INIT_PID_NS_INO = 0xEFFFFFFC  # the kernel's fixed inode number of the initial pid namespace
REUSE_SLACK_NS = 1_000_000_000  # clock-tick start times against file times: a second of doubt
_TICKS = os.sysconf("SC_CLK_TCK")


def _pgrp(pid: int | str) -> int:
    rest = stat_fields(pid)
    return int(rest[2]) if len(rest) > 2 else 0  # field 5, pgrp


def _leader_start_ns(pgid: int) -> int | None:
    """Wall-clock start of process ``pgid`` when it still leads group ``pgid``; None otherwise."""
    rest = stat_fields(pgid)
    try:
        if int(rest[2]) != pgid:
            return None
        ticks = int(rest[19])  # field 22, starttime: clock ticks since boot
    except (IndexError, ValueError):
        return None
    boot_ns = time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    return boot_ns + ticks * 1_000_000_000 // _TICKS


def _exists_here(pgid: int) -> bool:
    if pgid == 1:  # killpg(1) is kill(-1): every process. Look for a member instead.
        return any(_pgrp(entry) == 1 for entry in os.listdir("/proc") if entry.isdigit())
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    return True


def in_initial_pid_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INIT_PID_NS_INO
    except OSError:
        return False


class GroupJudge:
    """Verdicts for one scan; the walk over nested pid namespaces is made at most once."""

    def __init__(self) -> None:
        self._nested: frozenset[int] | None = None
        self._initial: bool | None = None

    def nested_pgids(self) -> frozenset[int]:
        """Group ids, as seen inside their own namespace, of every process in a nested pid namespace."""
        if self._nested is None:
            found = set()
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/status", "rb") as fh:
                        for line in fh:
                            if line.startswith(b"NSpgid:"):
                                ids = line.split()[1:]
                                if len(ids) > 1:
                                    found.add(int(ids[-1]))
                                break
                except (OSError, ValueError):
                    continue
            self._nested = frozenset(found)
        return self._nested

    def verdict(self, pgid: int, written_ns: int) -> str:
        if not 0 < pgid <= MAX_PID:
            return "unknown"
        if _exists_here(pgid):
            started = _leader_start_ns(pgid)
            if started is None or started <= written_ns + REUSE_SLACK_NS:
                return "alive"
            dead = "reused"
        else:
            dead = "gone"
        if self._initial is None:
            self._initial = in_initial_pid_namespace()
        if not self._initial or pgid in self.nested_pgids():
            return "unknown"
        return dead
