"""What changed between two refreshes, as lines for the event log.

:func:`diff` compares consecutive scans: models appearing, going stale, coming back or disappearing; going
late (a heartbeat that stopped, or a process stopped inside a publish) and on time again; limit revisions
acknowledged (applied / deferred / conflict) and deferred limits that became applied; trims acknowledged with
the bytes they returned; policy revisions (min, priority) taken; memory one model gave another under pressure
(a donor's ``pressure.gave_count`` grew); sleeps and wakes with their cause (a controller's request takes a
revision, an engine's request does not); new problem files.
Each event carries a ``key`` so that an acknowledgement kvtop already reported for its own
request is not logged twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvcached_core import ModelSnapshot, Problem, format_bytes, model_id

INFO, GOOD, WARN, ERROR = "info", "good", "warn", "error"


@dataclass(frozen=True)
class Event:
    at: float  # wall-clock seconds
    kind: str  # watching, appeared, stale, live, disappeared, limit, trimmed, compacted, gave, policy, sleep, wake,
    # problem, action, error
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


def asker_name(given_to: int, models: Sequence[ModelSnapshot]) -> str:
    """The model a donor gave to (its ``pressure.given_to`` is the asker's ``layout.model_id``); one no longer
    listed is named by its pid."""
    for m in models:
        if model_id(m.pid, m.name) == given_to:
            return m.name
    return f"a model no longer listed (pid {given_to >> 32})"


def policy_text(m: ModelSnapshot) -> str:
    p = m.pressure
    return "-" if p is None else f"min {format_bytes(p.min_bytes) if p.min_bytes else 'none'}, priority {p.priority}"


def _policy_event(prev: ModelSnapshot, cur: ModelSnapshot, at: float) -> Event | None:
    """A policy revision the model took (kvctl policy, another kvtop): what it holds now."""
    old, new = prev.pressure, cur.pressure
    if old is None or new is None or new.policy_revision <= old.policy_revision:
        return None
    return Event(at, "policy", cur.name, f"policy r{new.policy_revision} applied: {policy_text(cur)}", GOOD,
                 ("policy", cur.name, new.policy_revision))


def _gave_event(prev: ModelSnapshot, cur: ModelSnapshot, models: Sequence[ModelSnapshot], at: float) -> Event | None:
    """A donor answered reclaims since the last refresh: the last one's figures, and the count when several."""
    old, new = prev.pressure, cur.pressure
    if old is None or new is None or new.gave_count <= old.gave_count:
        return None
    asker, took = asker_name(new.given_to, models), f"in {new.given_took_s * 1000:.0f} ms"
    if new.given_bytes:
        text = (f"gave {format_bytes(new.given_bytes)} to {asker} (cached {format_bytes(new.given_cached)}, "
                f"reserved {format_bytes(new.given_reserved)}) {took}")
    else:
        text = f"gave nothing to {asker} (no reserved or cached page above its min) {took}"
    count = new.gave_count - old.gave_count
    if count > 1:
        text += f"; {count} reclaims since the last refresh, {format_bytes(new.gave_total - old.gave_total)} in all"
    return Event(at, "gave", cur.name, text, INFO, ("gave", cur.name, new.gave_count))


CONTROLLER_WAKE = "a wake request (kvctl wake, kvtop's w, or kvctl route for a request)"
REQUEST_WAKE = "a request (its engine took one, or an alloc needed a page)"


def asleep_text(slept_bytes: int, took_s: float) -> str:
    """What a sleep gave back: every page it had mapped when the sleep began (pages the drain emptied too)."""
    return f"asleep: {format_bytes(slept_bytes)} released in {took_s * 1000:.0f} ms"


def asleep_key(name: str, revision: int, slept_bytes: int, took_s: float) -> tuple:
    """One sleep's key, the same from the refresh diff and from kvtop's own request: logged once."""
    return ("sleep", name, "asleep", revision, slept_bytes, took_s)


def wake_cause(prev_revision: int, revision: int) -> str:
    """Who woke the model: a controller's wake takes a revision; a request reaches the engine with none."""
    return CONTROLLER_WAKE if revision > prev_revision else REQUEST_WAKE


def _sleep_event(prev: ModelSnapshot, cur: ModelSnapshot, at: float) -> Event | None:
    """The model went to sleep, fell asleep or woke since the last refresh, and why (from its SLEEP words)."""
    old, new = prev.sleep, cur.sleep
    if old is None or new is None or "unknown" in (old.state, new.state):
        return None
    name, rev = cur.name, new.acked_revision
    asked = rev > old.acked_revision
    if new.state == "draining" and old.state == "awake":
        why = f"sleep request r{rev}" if asked else f"after-idle policy: {new.after_idle_s:g} s without a request"
        return Event(at, "sleep", name, f"going to sleep ({why}): running requests finish first", INFO,
                     ("sleep", name, "draining", rev))
    if new.state == "asleep" and old.state != "asleep":
        return Event(at, "sleep", name, asleep_text(new.slept_bytes, new.took_s), GOOD,
                     asleep_key(name, rev, new.slept_bytes, new.took_s))
    if new.state == "awake" and old.state in ("asleep", "draining"):
        before = "" if old.state == "asleep" else " before it slept"
        return Event(at, "wake", name, f"woken{before} by {wake_cause(old.acked_revision, rev)}", INFO,
                     ("wake", name, rev) if asked else ())
    if new.state == old.state == "awake" and (new.slept_bytes, new.took_s) != (old.slept_bytes, old.took_s):
        return Event(at, "wake", name, f"slept ({format_bytes(new.slept_bytes)} released in "
                     f"{new.took_s * 1000:.0f} ms) and was woken by {wake_cause(old.acked_revision, rev)}, "
                     "both since the last refresh", INFO)
    return None


def stuck_text(m: ModelSnapshot) -> str | None:
    """Why a late model's figures are old (its process stays inside a publish); None while they are read now."""
    age = m.figures_age_s
    if age is None:
        return None
    return (f"late: its process (pid {m.pid}) stays inside a publish (stopped, or held by a debugger); "
            f"its figures are the last known, {age:.1f} s old")


def _late_event(prev: ModelSnapshot, cur: ModelSnapshot, at: float) -> Event | None:
    """A live model going late, or on time again, in the words of its kind of late: a heartbeat that stopped, or
    a process that stays inside a publish (segment/stuck.py: its figures are then the last known). A model whose
    late turns from one kind to the other is logged again."""
    stuck, was_stuck = stuck_text(cur), prev.late and prev.figures_age_s is not None
    if cur.late and (not prev.late or (stuck is not None) != was_stuck):
        text = stuck or f"late: pid {cur.pid} runs but its heartbeat stopped (stopped or overloaded)"
        return Event(at, "late", cur.name, text, WARN)
    if prev.late and not cur.late:
        return Event(at, "live", cur.name, "publishing again" if was_stuck else "beating again", GOOD)
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
            elif m.status == "live":
                late = _late_event(old, m, at)
                if late is not None:
                    events.append(late)
            limit = _limit_event(old, m, at)
            if limit is not None:
                events.append(limit)
            policy = _policy_event(old, m, at)
            if policy is not None:
                events.append(policy)
            gave = _gave_event(old, m, cur, at)
            if gave is not None:
                events.append(gave)
            slept = _sleep_event(old, m, at)
            if slept is not None:
                events.append(slept)
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
