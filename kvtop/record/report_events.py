"""What ``kvctl report`` tells of each limit, trim, sleep and wake of a model, from its samples in time order.

Each ledger takes the model's consecutive samples (``prev``, ``cur``) as :mod:`kvtop.record.report` hands them,
with the time between them; like the report's other figures, a state seen in a sample holds until the next one,
and a change is placed at the sample that first shows it (within one sample interval of when it happened).

- A **limit** is one revision a controller asked for (``limit_revision``) and the allocator acknowledged
  (``applied_revision``), an engine's own ``set_limit`` (the asked bytes change, the revision does not), or a new
  total written to an upstream segment (``limit_bytes``). It is set at the first sample that shows it asked (or
  acknowledged, when no sample caught it pending), deferred while its status is ``deferred``, applied at the
  first sample whose status is ``applied`` (at once: the sample it was set at; a limit lifted applies at once).
  A limit in force at the window's first sample is reported as set before the window.
- **Trims** are the controllers' trims answered (``trim_ack_seq``'s increments) and the bytes every trim
  returned (``trimmed_total``'s increments; an engine's own trim counts one where the bytes grew without an
  answer). Another process (pid or start time changed) or a counter that went down counts from zero.
- **Sleeps**: each time the model fell asleep (``sleep.state`` ``asleep``; or slept and woke between two
  samples, its last sleep's figures changed), with the bytes it released (``sleep.slept_bytes``); each wake,
  from asleep or from draining (woken before it slept), by its cause as kvtop's log names it: a wake request
  takes a revision (``sleep.acked_revision`` grew), a request reaching the engine does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcached_core import ModelSnapshot


@dataclass(frozen=True)
class LimitSet:
    """One limit over the window."""

    revision: int  # the controller's revision; 0: an engine's own set_limit or an upstream total
    asked_bytes: int | None  # what was asked (None: the limit lifted)
    effective_bytes: int | None  # what holds: rounded down to whole page bundles (None: no limit)
    in_use_bytes: int  # what the model had pinned when it was set: a limit below it is deferred
    set_at: float | None  # None: set before the window
    status: str  # as acknowledged: applied, deferred, conflict, none (lifted); an upstream total: written, pending
    deferred_s: float  # while it held, seconds deferred (waiting for pages to empty)
    applied_at: float | None  # the first sample it showed applied; None: not in the window

    def to_dict(self) -> dict:
        return {"revision": self.revision, "asked_bytes": self.asked_bytes, "effective_bytes": self.effective_bytes,
                "in_use_bytes": self.in_use_bytes, "set_at": self.set_at, "status": self.status,
                "deferred_s": round(self.deferred_s, 3), "applied_at": self.applied_at}


@dataclass
class _Limit:
    revision: int
    asked: int | None
    effective: int | None
    in_use: int
    set_at: float | None
    status: str
    deferred_s: float = 0.0
    applied_at: float | None = None

    def result(self) -> LimitSet:
        return LimitSet(self.revision, self.asked, self.effective, self.in_use, self.set_at, self.status,
                        self.deferred_s, self.applied_at)


def _restarted(prev: ModelSnapshot, cur: ModelSnapshot) -> bool:
    return (prev.pid, prev.start_time) != (cur.pid, cur.start_time)


APPLIED = ("applied", "none", "written")  # holds as asked: applied, lifted, an upstream total written


class Limits:
    """Every limit a model was set over the window."""

    def __init__(self) -> None:
        self.done: list[_Limit] = []
        self.asked_at: dict[int, float] = {}  # revision -> the first sample that showed it asked, not yet acknowledged

    @property
    def current(self) -> _Limit | None:
        return self.done[-1] if self.done else None

    def first(self, at: float, cur: ModelSnapshot) -> None:
        """The window's first sample: a limit in force then was set before the window (applied_at None if it
        was applied already)."""
        if cur.limit_bytes is not None or cur.applied_revision > 0:
            self.done.append(_Limit(cur.applied_revision, _asked(cur), cur.limit_bytes, cur.pinned_bytes, None,
                                    cur.limit_status))
        self._note_asked(at, cur)

    def add(self, prev: ModelSnapshot, cur: ModelSnapshot, at: float, held_for: float) -> bool:
        """Count the interval from ``prev`` to ``cur``; True when ``cur`` shows a limit set since ``prev``."""
        now = self.current
        if now is not None and prev.limit_status == "deferred":
            now.deferred_s += held_for
        self._note_asked(at, cur)
        if _is_new(prev, cur):
            set_at = self.asked_at.pop(cur.applied_revision, at) if cur.applied_revision else at
            self.done.append(_Limit(cur.applied_revision, _asked(cur), cur.limit_bytes, prev.pinned_bytes, set_at,
                                    cur.limit_status, applied_at=at if cur.limit_status in APPLIED else None))
            return True
        if now is not None and now.applied_at is None and prev.limit_status not in APPLIED \
                and cur.limit_status in APPLIED:
            now.applied_at = at
        return False

    def _note_asked(self, at: float, cur: ModelSnapshot) -> None:
        if cur.limit_revision > cur.applied_revision:
            self.asked_at.setdefault(cur.limit_revision, at)

    def result(self) -> tuple[LimitSet, ...]:
        return tuple(limit.result() for limit in self.done)


def _asked(m: ModelSnapshot) -> int | None:
    """The bytes asked of the limit ``m`` holds (an upstream total is its own ask)."""
    return m.limit_bytes if m.legacy else m.requested_limit


def _is_new(prev: ModelSnapshot, cur: ModelSnapshot) -> bool:
    """``cur`` holds a limit ``prev`` did not: a new revision acknowledged, an engine's own, an upstream total."""
    if cur.legacy or prev.legacy:
        return cur.limit_bytes != prev.limit_bytes
    if _restarted(prev, cur):
        return cur.applied_revision > 0 or cur.limit_bytes is not None
    if cur.applied_revision != prev.applied_revision:
        return True
    return cur.requested_limit != prev.requested_limit and cur.limit_revision <= cur.applied_revision


@dataclass(frozen=True)
class Trims:
    count: int
    bytes: int

    def to_dict(self) -> dict:
        return {"count": self.count, "bytes": self.bytes}


class TrimCounter:
    """Trims answered and bytes they returned, from the cumulative counters."""

    def __init__(self) -> None:
        self.count = self.bytes = 0

    def add(self, prev: ModelSnapshot, cur: ModelSnapshot) -> bool:
        """Count the trims from ``prev`` to ``cur``; True when there was one."""
        ack0, total0 = prev.trim_ack_seq, prev.trimmed_total
        if _restarted(prev, cur) or cur.trim_ack_seq < ack0 or cur.trimmed_total < total0:
            ack0 = total0 = 0  # another process, or its counters began again: all it shows is new
        answered = cur.trim_ack_seq - ack0
        returned = cur.trimmed_total - total0
        if answered <= 0 and returned <= 0:
            return False
        self.count += max(answered, 1)  # bytes without an answer: the engine trimmed on its own
        self.bytes += returned
        return True

    def result(self) -> Trims:
        return Trims(self.count, self.bytes)


REQUEST, CONTROLLER = "request", "wake request"


@dataclass(frozen=True)
class Sleeps:
    count: int  # times it fell asleep
    released_bytes: int  # what those sleeps released
    wakes: int
    woken_by_request: int  # a request reached its engine
    woken_by_controller: int  # a wake request (kvctl wake, kvtop's w, kvctl route for a request)
    woken_before_asleep: int  # of the wakes, those that came while it still drained

    def to_dict(self) -> dict:
        return {"count": self.count, "released_bytes": self.released_bytes, "wakes": self.wakes,
                "woken_by_request": self.woken_by_request, "woken_by_controller": self.woken_by_controller,
                "woken_before_asleep": self.woken_before_asleep}


class SleepCounter:
    """Sleeps and wakes from the model's sleep words."""

    def __init__(self) -> None:
        self.count = self.released = 0
        self.by = {REQUEST: 0, CONTROLLER: 0}
        self.before_asleep = 0

    def add(self, prev: ModelSnapshot, cur: ModelSnapshot) -> tuple[bool, bool]:
        """Count the sleeps and wakes from ``prev`` to ``cur``: (fell asleep, woke)."""
        old, new = prev.sleep, cur.sleep
        if old is None or new is None or "unknown" in (old.state, new.state) or _restarted(prev, cur):
            return False, False
        cause = CONTROLLER if new.acked_revision > old.acked_revision else REQUEST
        if new.state == "asleep" and old.state != "asleep":
            self.count += 1
            self.released += new.slept_bytes
            return True, False
        if new.state == "awake" and old.state in ("asleep", "draining"):
            self.by[cause] += 1
            self.before_asleep += old.state == "draining"
            return False, True
        if new.state == old.state == "awake" and (new.slept_bytes, new.took_s) != (old.slept_bytes, old.took_s):
            self.count += 1  # slept and woke between the two samples
            self.released += new.slept_bytes
            self.by[cause] += 1
            return True, True
        return False, False

    def result(self) -> Sleeps:
        return Sleeps(self.count, self.released, sum(self.by.values()), self.by[REQUEST], self.by[CONTROLLER],
                      self.before_asleep)
