"""One liveness verdict for a segment's writer, used by readers, kvctl clean, name reuse and the capacity ledger.

A writer in our pid namespace that recorded its start time is judged by pid + start time: it
is alive exactly while that process exists, however late its heartbeat (the capacity ledger,
which must trust what it counts, also asks that the file's owner runs that process). A writer we cannot identify
(another pid namespace, e.g. a container sharing /dev/shm, or no start time recorded) is judged
by its heartbeat alone and is taken for gone only when the heartbeat is :data:`HEARTBEAT_GONE_S`
old. A heartbeat from the future is never fresh.

Removal asks more than "gone" (:func:`removable`): a segment whose heartbeat is fresh is never
removed, whatever its pid says (a writer that just died leaves nothing to hurry for, and one
whose pid we misjudge, e.g. a namespace we cannot see, would lose a live segment).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import layout as L
from .procinfo import is_alive

HEARTBEAT_STALE_S = 3.0  # a heartbeat older than this is late (written every 0.5 s: kvcached_core.allocator.poller)
HEARTBEAT_GONE_S = 30.0  # a writer judged by its heartbeat alone is gone after this long without one
FUTURE_SLACK_S = 1.0  # clock steps between processes on one host; later than this is a forged or broken clock
_NS = 1_000_000_000


@functools.cache
def own_pid_ns() -> int:
    """The inode number of this process's pid namespace (0 when /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Verdict:
    alive: bool
    late: bool  # the heartbeat is older than HEARTBEAT_STALE_S, or from the future
    by_pid: bool  # judged by pid + start time; False: by the heartbeat alone


def identifiable(pid: int, start_time: int, pid_ns: int) -> bool:
    """Whether ``pid`` names the writer in our pid namespace (0: a segment that did not record one)."""
    return start_time != 0 and pid_ns in (0, own_pid_ns())


def heartbeat_late(heartbeat_ns: int, now_ns: int) -> bool:
    """Whether a heartbeat read at ``now_ns`` is late: older than HEARTBEAT_STALE_S, or from the future."""
    age = now_ns - heartbeat_ns
    return age < -FUTURE_SLACK_S * _NS or age >= HEARTBEAT_STALE_S * _NS


AliveCheck = Callable[[int, int, int | None], bool]  # procinfo.is_alive's shape: (pid, start time, uid)


def judge(pid: int, start_time: int, pid_ns: int, heartbeat_ns: int, now_ns: int,
          owner_uid: int | None = None, alive: AliveCheck = is_alive) -> Verdict:
    """The verdict on a writer from its header fields and heartbeat, read at ``now_ns`` (CLOCK_REALTIME).

    ``alive`` answers for pid + start time: :func:`procinfo.is_alive`, or a scan's memo of it
    (:class:`AliveMemo`) so that 64 models of one process cost one look at /proc, not 64.
    """
    age = now_ns - heartbeat_ns
    future = age < -FUTURE_SLACK_S * _NS
    late = heartbeat_late(heartbeat_ns, now_ns)
    if identifiable(pid, start_time, pid_ns):
        return Verdict(alive(pid, start_time, owner_uid), late, True)
    return Verdict(not future and age < HEARTBEAT_GONE_S * _NS, late, False)


class AliveMemo:
    """:func:`procinfo.is_alive`, asked once per (pid, start time, uid) for the life of the memo: one scan.

    A scan is one instant; a process that dies during it is seen dead by the next scan.
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int, int | None], bool] = {}

    def __call__(self, pid: int, started: int, uid: int | None = None) -> bool:
        key = (pid, started, uid)
        verdict = self._seen.get(key)
        if verdict is None:
            verdict = self._seen[key] = is_alive(pid, started, uid)
        return verdict


def writer_alive(header: dict, body: bytes, owner_uid: int | None = None) -> bool:
    """The verdict on the writer of a header (fields by name) given its file's first bytes (the heartbeat)."""
    heartbeat = L.U64.unpack_from(body, L.HEARTBEAT_OFF)[0] if len(body) >= L.HEARTBEAT_OFF + 8 else 0
    return judge(header["pid"], header["start_time"], header.get("pid_ns", 0), heartbeat, time.time_ns(),
                 owner_uid).alive


def removable(header: dict, body: bytes, owner_uid: int | None = None) -> bool:
    """Whether ``kvctl clean`` may remove the segment: its writer is gone and its heartbeat is not fresh."""
    heartbeat = L.U64.unpack_from(body, L.HEARTBEAT_OFF)[0] if len(body) >= L.HEARTBEAT_OFF + 8 else 0
    verdict = judge(header["pid"], header["start_time"], header.get("pid_ns", 0), heartbeat, time.time_ns(),
                    owner_uid)
    return not verdict.alive and verdict.late
