"""``kvtop --replay``: the dashboard's clock and source over a recording (``kvctl record``) instead of live segments.

The :class:`ReplayClock` says which moment of the recording is on screen: paused or playing at a speed,
stepped one sample at a time, or moved to a moment (:func:`parse_moment` reads what a person types). The
:class:`ReplaySource` is the dashboard's source (``kvtop.frames.source.Source``): each read is the recording's frame
at the clock's moment, read in the poller's thread as a live read is; it also hands the event log the
recorded events up to that moment and the history the sparklines and rates need, and it refuses every
request that would change a model. No drawing here: ``kvtop.replay.app`` is the screen.
"""

from __future__ import annotations

import bisect
import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import kvcached_core as kc
from kvcached_core import ControlError, ModelSnapshot
from kvtop.frames.events import Event
from kvtop.frames.history import DEPTH, History
from kvtop.frames.source import Frame
from kvtop.record import reading as R
from kvtop.record.reading import RecordedEvent, Recording

SPEEDS = (1, 2, 5, 10, 30, 60, 120, 300, 600)
REFUSED = "replay: actions that change models are off"
# What n / N stop at, one choice after another (e): every event the log shows, or the events of some kinds.
# Each recorded kind (kvtop.record.reading.EVENT_KINDS) is in exactly one of the narrower choices.
EVENT_FILTERS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("every event", None),
    ("limits", (R.LIMIT_DEFERRED, R.LIMIT_APPLIED, R.LIMIT_CONFLICT, R.LIMIT)),
    ("trims", (R.TRIM,)),
    ("sleeps and wakes", (R.SLEEP, R.WAKE)),
    ("reclaims", (R.RECLAIM,)),
    ("policies", (R.POLICY,)),
    ("models coming, going, stale or late", (R.START, R.APPEARED, R.STALE, R.LIVE, R.LATE, R.GONE)),
    ("problem files", (R.PROBLEM,)),
)
TICK_S = 0.1  # while playing, the poller reads at most this often (a 600x replay skips samples between reads)
LOG_LINES = 1000  # as many lines as the event log keeps
LOG_WINDOW_S = 600.0  # a seek reads the events this far back first, then further while the log is not full


class ReplayClock:
    """The moment on screen, over the recording's sample times; set from the UI thread, read by the poller's.

    Playing, the moment moves ``speed`` seconds of the recording per wall second and stops at the end.
    """

    def __init__(self, times: Sequence[float], *, at: float | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not times:
            raise ValueError("a recording without samples has no moment to show")
        self.times = sorted(times)
        self.start, self.end = self.times[0], self.times[-1]
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._at = self.start if at is None else self._clamp(at)
        self._since = monotonic()
        self._playing = False
        self._speed = SPEEDS[0]

    def _clamp(self, t: float) -> float:
        return min(self.end, max(self.start, t))

    def _advance(self) -> None:
        """Under the lock: move the moment on by the wall time since the last look."""
        now = self._monotonic()
        if self._playing:
            self._at = min(self.end, self._at + (now - self._since) * self._speed)
            if self._at >= self.end:
                self._playing = False
        self._since = now

    def now(self) -> float:
        """The recording's moment on screen now (seconds since the epoch)."""
        with self._lock:
            self._advance()
            return self._at

    @property
    def playing(self) -> bool:
        with self._lock:
            self._advance()
            return self._playing

    @property
    def speed(self) -> int:
        return self._speed

    def play(self) -> bool:
        """Play from the moment shown; False at the end of the recording (nothing left to play)."""
        with self._lock:
            self._advance()
            self._playing = self._at < self.end
            return self._playing

    def pause(self) -> None:
        with self._lock:
            self._advance()
            self._playing = False

    def set_speed(self, step: int) -> int:
        """One step along :data:`SPEEDS` (``+1`` faster, ``-1`` slower); the speed now."""
        with self._lock:
            self._advance()
            here = SPEEDS.index(self._speed)
            self._speed = SPEEDS[max(0, min(len(SPEEDS) - 1, here + step))]
            return self._speed

    def seek(self, t: float) -> float:
        """Show moment ``t`` (kept within the recording); playing goes on from there."""
        with self._lock:
            self._advance()
            self._at = self._clamp(t)
            return self._at

    def sample_index(self, t: float) -> int:
        """The sample shown at ``t``: the last one taken at or before it."""
        return max(0, bisect.bisect_right(self.times, t) - 1)

    def sample_at(self, t: float) -> float:
        return self.times[self.sample_index(t)]

    def step(self, samples: int) -> float:
        """Pause and move ``samples`` samples on (negative: back) from the one shown; the moment now."""
        with self._lock:
            self._advance()
            self._playing = False
            here = self.sample_index(self._at)
            self._at = self.times[max(0, min(len(self.times) - 1, here + samples))]
            return self._at

    def wait_s(self) -> float | None:
        """How long the poller may sleep before the sample shown changes (None: paused, until woken)."""
        with self._lock:
            self._advance()
            if not self._playing:
                return None
            nxt = bisect.bisect_right(self.times, self._at)
            if nxt >= len(self.times):
                return TICK_S
            return max(TICK_S, (self.times[nxt] - self._at) / self._speed)


# -- moments a person types ---------------------------------------------------------------------------

RELATIVE = re.compile(r"^([+-])((?:\d+(?:\.\d+)?[hms])+)$")
PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")
CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}(?:\.\d+)?))?$")
UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}
FORMS = "HH:MM[:SS], an ISO time (2026-01-01T03:00), or +10m / -30s"


def format_moment(t: float, with_date: bool = True) -> str:
    """A moment in local time, as the time bar and the messages write it."""
    return time.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S", time.localtime(t))


def parse_moment(text: str, *, start: float, end: float, now: float) -> float:
    """The moment ``text`` names within [start, end]: ``HH:MM[:SS]`` (local time; of the recording's days, the
    one nearest ``now``), an ISO time (local unless it names a zone), or ``+10m`` / ``-30s`` / ``+1h30m`` from
    ``now``. ValueError, one line, when it is none of these or falls outside the recording."""
    text = text.strip()
    if not text:
        raise ValueError(f"type a moment: {FORMS}")
    rel = RELATIVE.match(text)
    if rel:
        seconds = sum(float(n) * UNIT_S[u] for n, u in PART.findall(rel.group(2)))
        return within(now + seconds if rel.group(1) == "+" else now - seconds, text, start, end)
    clock = CLOCK.match(text)
    if clock:
        hours, minutes = int(clock.group(1)), int(clock.group(2))
        seconds = float(clock.group(3) or 0)
        if hours > 23 or minutes > 59 or seconds >= 60:
            raise ValueError(f"{text!r} is not a time of day")
        return _time_of_day(text, hours, minutes, seconds, start, end, now)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a moment: {FORMS}") from None
    return within(moment.timestamp(), text, start, end)


def within(t: float, text: str, start: float, end: float) -> float:
    if not start <= t <= end:
        raise ValueError(f"{text} ({format_moment(t)}) is outside the recording: "
                         f"{format_moment(start)} to {format_moment(end)}")
    return t


def _time_of_day(text: str, hours: int, minutes: int, seconds: float, start: float, end: float,
                 now: float) -> float:
    day = datetime.fromtimestamp(start).date() - timedelta(days=1)
    last = datetime.fromtimestamp(end).date()
    found: list[float] = []
    while day <= last:
        at = datetime(day.year, day.month, day.day, hours, minutes).timestamp() + seconds
        if start <= at <= end:
            found.append(at)
        day += timedelta(days=1)
    if not found:
        raise ValueError(f"{text} is outside the recording: {format_moment(start)} to {format_moment(end)}")
    return min(found, key=lambda at: abs(at - now))


# -- the source ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogUpdate:
    """What the event log shows next: ``events`` after the lines it has, or instead of them (``reset``)."""

    events: tuple[Event, ...]
    reset: bool


def log_event(e: RecordedEvent) -> Event:
    return Event(e.at, e.kind, e.model, e.text, e.level)


class ReplaySource:
    """The dashboard's source over a recording: frames at the clock's moment; no request reaches a model.

    ``read``, ``log`` and ``history`` are called from the poller's thread only, so the little state they keep
    (the last frame, the last events handed out) needs no lock of its own; every use of the recording holds
    ``lock`` (the event searches run in another worker).
    """

    def __init__(self, recording: Recording, clock: ReplayClock) -> None:
        self.recording = recording
        self.clock = clock
        self.lock = threading.Lock()
        self._frame: Frame | None = None
        self._frame_key: tuple[float, str | None] | None = None
        self._log_upto: float | None = None
        self._history_at: float | None = None

    # -- reading (the poller's thread) ------------------------------------------------------------
    def read(self, selected: str | None) -> Frame:
        """The recording's frame at the clock's moment; the same object while neither the sample nor the
        selection changed (the poller then posts nothing)."""
        sample = self.clock.sample_at(self.clock.now())
        key = (sample, selected)
        if self._frame is None or key != self._frame_key:
            with self.lock:
                self._frame = self.recording.frame_at(sample, selected)
            self._frame_key = key
        return self._frame

    def log(self, upto: float) -> LogUpdate:
        """The recorded events up to ``upto`` that the log lacks: those since the last call when the moment
        moved on, else the last :data:`LOG_LINES` of them in place of the log's lines."""
        last = self._log_upto
        self._log_upto = upto
        if last is not None and upto >= last:
            if upto == last:
                return LogUpdate((), False)
            return LogUpdate(tuple(log_event(e) for e in self._events(last, upto) if e.at > last), False)
        start, window = self.recording.start, LOG_WINDOW_S
        while True:
            since = max(start, upto - window)
            events = self._events(since, upto)
            if len(events) >= LOG_LINES or since <= start:
                return LogUpdate(tuple(log_event(e) for e in events[-LOG_LINES:]), True)
            window *= 8

    def _events(self, t0: float, t1: float) -> list[RecordedEvent]:
        with self.lock:
            return self.recording.events(t0, t1)

    def event_near(self, t: float, direction: int, kinds: Collection[str] | None = None) -> RecordedEvent | None:
        """The first event after ``t`` (``direction`` 1), or the last one before it (-1): of any kind the log shows,
        or of ``kinds`` when given."""
        if direction > 0:
            with self.lock:
                return self.recording.next_event_after(t, kinds)
        start, window = self.recording.start, LOG_WINDOW_S
        while True:
            since = max(start, t - window)
            found = [e for e in self._events(since, t) if e.at < t and (kinds is None or e.kind in kinds)]
            if found or since <= start:
                return found[-1] if found else None
            window *= 8

    def continues(self, upto: float) -> bool:
        """True when the sample at ``upto`` is the one last given or the one after it: the dashboard's history then
        needs only this frame; else it needs :meth:`history` (a seek, or a fast replay skipping samples)."""
        index = self.clock.sample_index(upto)
        last, self._history_at = self._history_at, upto
        return last is not None and (last == upto or (index > 0 and self.clock.times[index - 1] == last))

    def history(self, upto: float) -> History:
        """A history as the live dashboard would hold it at ``upto``: fed the :data:`DEPTH` samples before it
        (the sparklines) and its own (the rates between the last two)."""
        index = self.clock.sample_index(upto)
        history = History()
        with self.lock:
            for t in self.clock.times[max(0, index - DEPTH):index + 1]:
                history.update(self.recording.frame_at(t, None).models)
        return history

    # -- what a replay refuses --------------------------------------------------------------------
    def reread(self, model: ModelSnapshot) -> ModelSnapshot:
        return model  # the recording does not change under it

    def _refuse(self) -> kc.Ack:
        raise ControlError(REFUSED)

    def trim(self, model: ModelSnapshot, wait: float) -> kc.Ack:
        return self._refuse()

    def compact(self, model: ModelSnapshot, wait: float) -> kc.Ack:
        return self._refuse()

    def sleep(self, model: ModelSnapshot, action: str, wait: float) -> kc.Ack:
        return self._refuse()

    def limit(self, model: ModelSnapshot, limit_bytes: int | None, wait: float) -> kc.Ack:
        return self._refuse()

    def policy(self, model: ModelSnapshot, min_bytes: int | None | object, priority: int | object,
               wait: float) -> kc.Ack:
        return self._refuse()

    def close(self) -> None:
        with self.lock:
            self.recording.close()
