"""What changed between two refreshes, as lines for the event log.

:func:`diff` compares consecutive scans: models appearing, going stale, coming back or
disappearing; limit revisions acknowledged (applied / deferred / conflict) and deferred limits
that became applied; trims acknowledged with the bytes they returned; new problem files.
Each event carries a ``key`` so that an acknowledgement kvtop already reported for its own
request is not logged twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvcached_core import format_bytes
from kvcached_core.segment.snapshot import ModelSnapshot, Problem

INFO, GOOD, WARN, ERROR = "info", "good", "warn", "error"


@dataclass(frozen=True)
class Event:
    at: float  # wall-clock seconds
    kind: str  # watching, appeared, stale, live, disappeared, limit, trimmed, compacted, problem, action, error
    model: str
    text: str
    level: str = INFO
    key: tuple = ()

    def clock(self) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.at))


def limit_text(m: ModelSnapshot) -> str:
    return "none" if m.limit_bytes is None else format_bytes(m.limit_bytes)


def _limit_event(prev: ModelSnapshot, cur: ModelSnapshot, at: float) -> Event | None:
    if cur.legacy:
        if prev.limit_bytes != cur.limit_bytes:
            return Event(at, "limit", cur.name, f"limit (total) now {limit_text(cur)}", INFO)
        return None
    if cur.applied_revision > prev.applied_revision:
        status = cur.limit_status
        level = WARN if status in ("deferred", "conflict") else GOOD
        text = f"limit r{cur.applied_revision} acknowledged: {status}, effective {limit_text(cur)}"
        if status == "deferred" and cur.requested_limit is not None:
            text = (f"limit r{cur.applied_revision} acknowledged: deferred, {format_bytes(cur.requested_limit)}"
                    f" asked, {format_bytes(cur.pinned_bytes)} still in use")
        return Event(at, "limit", cur.name, text, level, ("limit", cur.name, cur.applied_revision))
    if prev.limit_status == "deferred" and cur.limit_status == "applied":
        return Event(at, "limit", cur.name, f"deferred limit now applied: {limit_text(cur)}", GOOD)
    return None


def diff(prev: Sequence[ModelSnapshot] | None, cur: Sequence[ModelSnapshot], at: float,
         prev_problems: Sequence[Problem] = (), problems: Sequence[Problem] = ()) -> list[Event]:
    """Events between two scans; ``prev=None`` (the first refresh) gives one summary line."""
    events: list[Event] = []
    if prev is None:
        names = ", ".join(m.name for m in cur) or "none yet"
        events.append(Event(at, "watching", "", f"watching {len(cur)} models: {names}"))
    else:
        before = {m.name: m for m in prev}
        now = {m.name: m for m in cur}
        for name, m in now.items():
            old = before.get(name)
            if old is None:
                where = f"{m.engine}, pid {m.pid}" if m.pid else m.engine
                events.append(Event(at, "appeared", name, f"appeared ({where}, {m.display_status})", INFO))
                continue
            if old.status == "live" and m.status == "stale":
                events.append(Event(at, "stale", name, f"went stale: its process (pid {m.pid}) is gone", WARN))
            elif old.status == "stale" and m.status == "live":
                events.append(Event(at, "live", name, "live again", GOOD))
            elif m.status == "live" and m.late and not old.late:
                events.append(Event(at, "late", name, f"late: pid {m.pid} runs but its heartbeat stopped "
                                    "(stopped or overloaded)", WARN))
            elif m.status == "live" and old.late and not m.late:
                events.append(Event(at, "live", name, "beating again", GOOD))
            limit = _limit_event(old, m, at)
            if limit is not None:
                events.append(limit)
            if m.trim_ack_seq > old.trim_ack_seq:
                events.append(Event(at, "trimmed", name, f"trimmed: {format_bytes(m.trim_bytes)} returned", GOOD,
                                    ("trim", name, m.trim_ack_seq)))
        for name in before.keys() - now.keys():
            events.append(Event(at, "disappeared", name, "disappeared (segment removed)", INFO))
    seen = {p.path for p in prev_problems}
    for p in problems:
        if p.path not in seen:
            events.append(Event(at, "problem", p.path, f"{p.status}: {p.reason}", WARN))  # the log shows the path once
    return events
