"""The figures of ``kvctl report``: what each model of a recording did over a window of time.

Every figure comes from the samples' counters (:meth:`Recording.samples`, every model of a sample at
once, each sample decoded once); only the events listed with a model (:func:`with_events`) are the
recording's own event rows. Limits, trims, sleeps and wakes are counted by :mod:`kvtop.record.report_events`;
the rest here:

- a sample's state (its limit deferred, its sleep state) is taken to hold from that sample to the next
  sample of the same model in the window, so each duration is within one sample interval of the truth at
  each change; the last sample in the window counts for nothing;
- means (mapped bytes, waste, requests waiting) are over the samples, which the recorder takes at a fixed
  interval; waste and waiting leave out the samples where they are unknown (nothing held, no traffic
  published);
- reclaims are the increments of the cumulative counters between consecutive samples: ``took_count`` and
  ``took_total`` for reclaims taken, ``gave_count`` and ``gave_total`` for reclaims given. A sample whose
  process is another one (pid or start time changed) or whose counter went down starts the count again
  from zero: everything it shows accrued since the previous sample. Each interval where a count grew gives
  one latency, the one the later sample publishes: the last reclaim's (``latency_s`` for a reclaim taken,
  from the ask to the bytes given; ``given_took_s`` for one given, from the request to the answer). Where
  several reclaims fell in one interval only the last one's latency is known, so the percentiles are over
  the intervals, not the reclaims; they are nearest-rank percentiles.

A figure a model cannot have (no traffic published, no sleep handler, an upstream segment's) is listed in
``unknown`` with why, instead of a bare ``-``. No click and no drawing here: ``kvtop.cli.report`` prints (its
text from ``kvtop.record.report_text``), ``kvtop.record.report_plot`` draws.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from kvcached_core import ModelNotFound, ModelSnapshot

from .reading import RecordedEvent
from .report_events import Limits, LimitSet, SleepCounter, Sleeps, TrimCounter, Trims

# The marks on a plot, where a sample differs from the one before it.
MARK_KINDS = ("limit set", "limit deferred", "limit applied", "trim", "reclaim", "sleep", "wake")

# The figures a model cannot have, and why (the report says so instead of a bare "-").
NO_TRAFFIC = "its engine publishes no traffic figures (requests running and waiting)"
NOTHING_HELD = "it held no block in any sample"
NO_SLEEP_STATE = "an upstream kvcached segment publishes no sleep state"
CANNOT_SLEEP = "its engine registered no sleep handler: it cannot sleep"
NO_RECLAIMS = "an upstream kvcached segment publishes no reclaim counters"
NO_TRIMS = "an upstream kvcached segment cannot be trimmed from outside"
NO_BLOCKS = "an upstream kvcached segment publishes no blocks"
UNREADABLE = "its {} read as unknown in every sample (words no allocator writes)"


@dataclass(frozen=True)
class Reclaims:
    """Reclaims one side of which is the model (given or taken) over the window."""

    bytes: int
    count: int
    latencies_s: tuple[float, ...]  # one per sample interval where the count grew (see the module's note)

    @property
    def p50_s(self) -> float | None:
        return percentile(self.latencies_s, 50)

    @property
    def p99_s(self) -> float | None:
        return percentile(self.latencies_s, 99)

    def to_dict(self) -> dict:
        p50, p99 = self.p50_s, self.p99_s
        return {"bytes": self.bytes, "count": self.count, "latencies": len(self.latencies_s),
                "latency_p50_s": None if p50 is None else round(p50, 6),
                "latency_p99_s": None if p99 is None else round(p99, 6)}


@dataclass(frozen=True)
class Mark:
    """Something that happened to a model between two samples, placed at the later one."""

    at: float
    model: str
    kind: str  # one of MARK_KINDS
    mapped_bytes: int  # the model's mapped bytes at that sample (where a plot puts the mark)


@dataclass(frozen=True)
class ModelReport:
    """One model over the window."""

    name: str
    samples: int
    first_at: float  # seconds since the epoch: its first and last sample in the window
    last_at: float
    peak_mapped_bytes: int
    mean_mapped_bytes: int
    deferred_s: float  # with a lowered limit waiting for pages to empty (limit status deferred)
    asleep_s: float  # with its sleep state asleep
    given: Reclaims
    taken: Reclaims
    waste_mean: float | None  # pinned / held; None: nothing held in any sample
    waste_max: float | None
    waiting_mean: float | None  # requests its engine had waiting; None: no traffic published
    waiting_max: int | None
    limits: tuple[LimitSet, ...] = ()
    trims: Trims = Trims(0, 0)
    sleeps: Sleeps = Sleeps(0, 0, 0, 0, 0, 0)
    unknown: tuple[tuple[str, str], ...] = ()  # (figure, why): what this model cannot have
    marks: tuple[Mark, ...] = ()
    series: tuple[tuple[float, int], ...] = field(default=(), repr=False)  # (at, mapped bytes), when asked for
    events: tuple[RecordedEvent, ...] = ()  # the recorded events of the window (with_events)

    def to_dict(self) -> dict:
        return {"name": self.name, "samples": self.samples, "first_at": self.first_at, "last_at": self.last_at,
                "peak_mapped_bytes": self.peak_mapped_bytes, "mean_mapped_bytes": self.mean_mapped_bytes,
                "deferred_s": round(self.deferred_s, 3), "asleep_s": round(self.asleep_s, 3),
                "limits": [limit.to_dict() for limit in self.limits], "trims": self.trims.to_dict(),
                "sleeps": self.sleeps.to_dict(), "given": self.given.to_dict(), "taken": self.taken.to_dict(),
                "waste_mean": _round(self.waste_mean), "waste_max": _round(self.waste_max),
                "waiting_mean": _round(self.waiting_mean), "waiting_max": self.waiting_max,
                "unknown": [{"figure": figure, "why": why} for figure, why in self.unknown],
                "events": [{"at": e.at, "kind": e.kind, "level": e.level, "text": e.text} for e in self.events]}

    def why_unknown(self, figure: str) -> str | None:
        return next((why for name, why in self.unknown if name == figure), None)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile (the smallest value with at least p % of them at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class _Counter:
    """The increments of one cumulative (count, bytes) pair across samples, with the latency at each."""

    def __init__(self) -> None:
        self.count = self.bytes = 0
        self.latencies: list[float] = []

    def step(self, count: tuple[int, int], total: tuple[int, int], latency: float, restarted: bool) -> bool:
        """Count the increment from ``count[0]``/``total[0]`` to ``count[1]``/``total[1]``; True when it grew."""
        (count0, count1), (total0, total1) = count, total
        if restarted or count1 < count0 or total1 < total0:
            count0 = total0 = 0  # another process, or its counters began again: all it shows is new
        if count1 <= count0:
            return False
        self.count += count1 - count0
        self.bytes += total1 - total0
        self.latencies.append(latency)
        return True

    def result(self) -> Reclaims:
        return Reclaims(self.bytes, self.count, tuple(self.latencies))


def _asleep(s: ModelSnapshot) -> bool:
    return s.sleep is not None and s.sleep.state == "asleep"


def _marks(prev: ModelSnapshot, cur: ModelSnapshot, at: float, *, limit_set: bool, trimmed: bool, reclaimed: bool,
           slept: bool, woke: bool) -> Iterator[Mark]:
    def mark(kind: str) -> Mark:
        return Mark(at, cur.name, kind, cur.mapped_bytes)

    if cur.limit_status == "deferred" and (limit_set or prev.limit_status != "deferred"):
        yield mark("limit deferred")
    elif limit_set:
        yield mark("limit set")
    elif prev.limit_status == "deferred" and cur.limit_status == "applied":
        yield mark("limit applied")
    if trimmed:
        yield mark("trim")
    if reclaimed:
        yield mark("reclaim")
    if slept:
        yield mark("sleep")
    if woke:
        yield mark("wake")


class _Figures:
    """One model's figures, a sample at a time (samples in time order)."""

    def __init__(self, name: str, keep_series: bool) -> None:
        self.name, self.keep_series = name, keep_series
        self.count = self.peak = self.mapped_sum = 0
        self.first_at = self.last_at = 0.0
        self.deferred_s = self.asleep_s = 0.0
        self.given, self.taken = _Counter(), _Counter()
        self.wastes: list[float] = []
        self.waiting: list[int] = []
        self.marks: list[Mark] = []
        self.series: list[tuple[float, int]] = []
        self.prev: ModelSnapshot | None = None
        self.limits, self.trims, self.sleeps = Limits(), TrimCounter(), SleepCounter()
        self.seen_traffic = self.seen_pressure = self.seen_sleep = self.can_sleep = False
        self.legacy = True  # until a sample of ours says otherwise

    def add(self, at: float, snap: ModelSnapshot) -> None:
        prev = self.prev
        if prev is None:
            self.first_at = at
            self.limits.first(at, snap)
        else:
            held_for = max(0.0, at - self.last_at)
            if prev.limit_status == "deferred":
                self.deferred_s += held_for
            if _asleep(prev):
                self.asleep_s += held_for
            reclaimed = False
            if prev.pressure is not None and snap.pressure is not None:
                restarted = (prev.pid, prev.start_time) != (snap.pid, snap.start_time)
                p0, p1 = prev.pressure, snap.pressure
                reclaimed = self.taken.step((p0.took_count, p1.took_count), (p0.took_total, p1.took_total),
                                            p1.latency_s, restarted)
                gave = self.given.step((p0.gave_count, p1.gave_count), (p0.gave_total, p1.gave_total),
                                       p1.given_took_s, restarted)
                reclaimed = reclaimed or gave
            limit_set = self.limits.add(prev, snap, at, held_for)
            trimmed = self.trims.add(prev, snap)
            slept, woke = self.sleeps.add(prev, snap)
            self.marks.extend(_marks(prev, snap, at, limit_set=limit_set, trimmed=trimmed, reclaimed=reclaimed,
                                     slept=slept, woke=woke))
        self.seen_traffic |= snap.traffic is not None
        self.seen_pressure |= snap.pressure is not None
        self.seen_sleep |= snap.sleep is not None and snap.sleep.state != "unknown"
        self.can_sleep |= snap.sleep is not None and snap.sleep.capable
        self.legacy &= snap.legacy
        self.count += 1
        self.last_at = at
        self.peak = max(self.peak, snap.mapped_bytes)
        self.mapped_sum += snap.mapped_bytes
        ratio = snap.waste_ratio
        if ratio is not None:
            self.wastes.append(ratio)
        if snap.traffic is not None:
            self.waiting.append(snap.traffic.waiting)
        if self.keep_series:
            self.series.append((at, snap.mapped_bytes))
        self.prev = snap

    def unknown(self) -> tuple[tuple[str, str], ...]:
        """The figures this model cannot have over the window, and why."""
        out: list[tuple[str, str]] = []
        if self.legacy:
            out += [("trims", NO_TRIMS), ("sleeps", NO_SLEEP_STATE), ("reclaims", NO_RECLAIMS), ("waste", NO_BLOCKS)]
        else:
            if not self.seen_sleep:
                out.append(("sleeps", UNREADABLE.format("sleep state")))
            elif not self.can_sleep and not self.sleeps.count:
                out.append(("sleeps", CANNOT_SLEEP))
            if not self.seen_pressure:
                out.append(("reclaims", UNREADABLE.format("reclaim counters")))
            if not self.wastes:
                out.append(("waste", NOTHING_HELD))
        if not self.waiting:
            out.append(("waiting", NO_TRAFFIC))
        return tuple(out)

    def result(self) -> ModelReport | None:
        if not self.count:
            return None
        wastes, waiting = self.wastes, self.waiting
        return ModelReport(
            self.name, self.count, self.first_at, self.last_at, self.peak, round(self.mapped_sum / self.count),
            self.deferred_s, self.asleep_s, self.given.result(), self.taken.result(),
            sum(wastes) / len(wastes) if wastes else None, max(wastes) if wastes else None,
            sum(waiting) / len(waiting) if waiting else None, max(waiting) if waiting else None,
            self.limits.result(), self.trims.result(), self.sleeps.result(), self.unknown(),
            tuple(self.marks), tuple(self.series))


def model_report(name: str, samples: Iterable[tuple[float, ModelSnapshot]], *,
                 keep_series: bool = False) -> ModelReport | None:
    """The figures of one model from its samples in time order; None when there is none."""
    figures = _Figures(name, keep_series)
    for at, snap in samples:
        figures.add(at, snap)
    return figures.result()


def model_reports(names: Sequence[str], samples: Iterable[tuple[float, Mapping[str, ModelSnapshot]]], *,
                  keep_series: bool = False) -> list[ModelReport]:
    """The figures of each of ``names`` (in that order; none for a model without a sample) from the samples of
    every model at once (``Recording.samples``), read once."""
    figures = {name: _Figures(name, keep_series) for name in names}
    for at, models in samples:
        for name, snap in models.items():
            one = figures.get(name)
            if one is not None:
                one.add(at, snap)
    return [r for r in (f.result() for f in figures.values()) if r is not None]


def with_events(reports: Sequence[ModelReport], events: Iterable[RecordedEvent]) -> list[ModelReport]:
    """The reports with each model's recorded events (``Recording.events`` over the window) in them."""
    by_model: dict[str, list[RecordedEvent]] = {r.name: [] for r in reports}
    for event in events:
        if event.model in by_model:
            by_model[event.model].append(event)
    return [replace(r, events=tuple(by_model[r.name])) for r in reports]


def pick_model(name: str, names: Sequence[str]) -> str:
    """A model of the recording by exact name or unique prefix, as kvctl names running ones
    (``kvcached_core.resolve``); ModelNotFound lists the candidates."""
    if name in names:
        return name
    matches = sorted(n for n in names if n.startswith(name))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ModelNotFound(f"model name {name!r} is ambiguous in this recording: {', '.join(matches)}", matches)
    known = ", ".join(sorted(names)) or "none"
    raise ModelNotFound(f"no model named {name!r} in this recording (known: {known})", sorted(names))


# -- moments: --from and --to ----------------------------------------------------------------------

_RELATIVE = re.compile(r"^([-+])(\d+(?:\.\d+)?)(s|m|h|d)$")
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MOMENT_FORMS = "an ISO time (2026-12-06T03:10), HH:MM[:SS] (that day of the recording), -2h (before its end) " \
    "or +30m (after its start)"


def moment_problem(text: str) -> str | None:
    """Why ``text`` is no moment a report takes (None when it is one): checked before the recording is read."""
    text = text.strip()
    if _RELATIVE.match(text):
        return None
    clock = _CLOCK.match(text)
    if clock:
        hour, minute, second = int(clock[1]), int(clock[2]), int(clock[3] or 0)
        return None if hour < 24 and minute < 60 and second < 60 else f"{text!r} is no time of day"
    try:
        datetime.fromisoformat(text)
    except ValueError:
        return f"{text!r} is not a time: give {MOMENT_FORMS}"
    return None


def moment(text: str, start: float, end: float) -> float:
    """Seconds since the epoch for ``text`` (see :func:`moment_problem`) in a recording from ``start`` to ``end``.

    ``-2h`` is two hours before the recording's end, ``+30m`` 30 minutes after its start (units s, m, h, d);
    ``HH:MM`` is that local time on the day the recording began (on the next day when it had passed at the
    start and the recording lasts until then the next day); an ISO time without a zone is local."""
    text = text.strip()
    relative = _RELATIVE.match(text)
    if relative:
        seconds = float(relative[2]) * _UNIT_S[relative[3]]
        return end - seconds if relative[1] == "-" else start + seconds
    clock = _CLOCK.match(text)
    if clock:
        began = datetime.fromtimestamp(start)
        at = began.replace(hour=int(clock[1]), minute=int(clock[2]), second=int(clock[3] or 0), microsecond=0)
        later = at + timedelta(days=1)
        if at.timestamp() < start and later.timestamp() <= end:
            at = later
        return at.timestamp()
    return datetime.fromisoformat(text).timestamp()  # naive: local time, as the clock form
