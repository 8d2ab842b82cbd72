"""Reading a recording back: any moment as a kvtop :class:`~kvtop.frames.source.Frame`, the events, the counters.

``Recording.open(path)`` takes one day file or a directory of them. A damaged row (its CRC does not
match, or it does not decode) reads as absent and is named once in ``problems``; a moment whose
rebuild needs it shows the last moment before it that can be rebuilt. Nothing here writes to a file.
"""

from __future__ import annotations

import bisect
import sqlite3
from array import array
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached_core import GpuInfo, ModelSnapshot, Problem
from kvtop.frames.source import Frame
from kvtop.record import codec
from kvtop.record.codec import PAGES_KEY, Damaged, Flat
from kvtop.record.schema import APPLICATION_ID, SCHEMA_VERSION, crc, day_files, event_crc_input, open_readonly

# Event kinds: kvtop's event log's, as recorded (kvtop.frames.events.Event.kind, with a limit's outcome named).
START = "start"  # the recorder began: the models it found
APPEARED = "appeared"
STALE = "stale"  # its process is gone
LIVE = "live"  # live again, beating or publishing again
LATE = "late"  # its process runs but does not beat, or stays inside a publish
GONE = "gone"  # its segment was removed
LIMIT_APPLIED = "limit_applied"
LIMIT_DEFERRED = "limit_deferred"
LIMIT_CONFLICT = "limit_conflict"
LIMIT = "limit"  # any other limit acknowledgement (an upstream row's total, a stale status)
RECLAIM = "reclaim"  # a donor gave memory to an asker (the event is the donor's)
POLICY = "policy"
SLEEP = "sleep"  # going to sleep, or asleep
WAKE = "wake"
TRIM = "trim"
PROBLEM = "problem"  # a file in the segment directory that is not a usable segment
EVENT_KINDS = (START, APPEARED, STALE, LIVE, LATE, GONE, LIMIT_APPLIED, LIMIT_DEFERRED, LIMIT_CONFLICT, LIMIT,
               RECLAIM, POLICY, SLEEP, WAKE, TRIM, PROBLEM)


class RecordingError(Exception):
    """The path cannot be read as a recording; the message is one line naming it and why."""


@dataclass(frozen=True)
class RecordedEvent:
    at: float  # wall-clock seconds
    kind: str  # one of EVENT_KINDS
    model: str  # "" for the recorder's own lines; a file's path for a problem
    text: str  # the line kvtop's event log showed
    level: str = "info"  # info, good, warn, error


@dataclass
class _State:
    """Everything a sample rebuilt from its key sample holds: the flat records, the frame's fields and the
    page map of the one model followed (None: none followed, or its map cannot be rebuilt)."""

    seq: int
    t: float
    order: list[str]
    models: dict[str, Flat]
    frame: dict[str, Any]
    followed: str | None = None
    map: bytes | None = None

    @property
    def base(self) -> int:
        return codec.time_base(self.t)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class _Day:
    """One day file, open read-only, with its sample index in memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problems: list[str] = []
        try:
            self.db = open_readonly(path)
        except sqlite3.Error as exc:
            raise RecordingError(f"{path}: unreadable: {_one_line(exc)}") from None
        try:
            self._check()
            self._index()
        except BaseException:
            self.db.close()
            raise
        self._cache: dict[str | None, _State] = {}  # the last state rebuilt, per model followed

    def _remember(self, state: _State) -> None:
        self._cache.pop(state.followed, None)
        self._cache[state.followed] = state
        while len(self._cache) > 4:
            del self._cache[next(iter(self._cache))]  # the one used longest ago

    def forget(self) -> None:
        """Drop the states kept to step on from (one of them read as damaged)."""
        self._cache.clear()

    def _check(self) -> None:
        path = self.path
        try:
            app = self.db.execute("PRAGMA application_id").fetchone()[0]
            meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            why = _one_line(exc)
            if "not a database" in why or "no such table" in why:
                raise RecordingError(f"{path}: not a recording ({why})") from None
            raise RecordingError(f"{path}: unreadable: {why}") from None
        if app != APPLICATION_ID or "schema_version" not in meta:
            raise RecordingError(f"{path}: not a recording (an SQLite file without kvctl record's schema)")
        try:
            version = int(meta["schema_version"])
        except ValueError:
            raise RecordingError(f"{path}: not a recording (schema version {meta['schema_version']!r})") from None
        if version > SCHEMA_VERSION:
            raise RecordingError(f"{path}: written by a newer kvctl record (schema {version}; this kvtop reads "
                                 f"up to {SCHEMA_VERSION}): read it with that version")
        if version < SCHEMA_VERSION:
            raise RecordingError(f"{path}: written by an older kvctl record (schema {version}; this kvtop reads "
                                 f"{SCHEMA_VERSION}): read it with that version")
        self.meta = meta
        self.zdict = str(meta.get("zdict", "")).encode("utf-8", "surrogateescape")

    def _cut_short(self) -> None:
        """Name a file shorter than its SQLite header says (a cut may take only pages no query reads); not while
        a WAL beside it holds commits (a checkpoint in progress may write the header before the pages)."""
        try:
            if self.path.with_name(self.path.name + "-wal").stat().st_size > 0:
                return
        except OSError:
            pass
        try:
            with self.path.open("rb") as f:
                head = f.read(32)
                size = f.seek(0, 2)
        except OSError:
            return
        if len(head) < 32:
            return
        page = int.from_bytes(head[16:18], "big")
        pages = int.from_bytes(head[28:32], "big")
        expected = pages * (65536 if page == 1 else page)
        if size < expected:
            self.problems.append(f"{self.path}: the file is cut short ({size} of its {expected} bytes): what is "
                                 "in it is read")

    def _index(self) -> None:
        self._cut_short()
        self.seqs = array("q")
        self.times = array("d")
        self.keys = array("q")
        last_t = float("-inf")
        try:
            for seq, t, key in self.db.execute("SELECT seq, t, key FROM samples ORDER BY seq"):
                if not isinstance(t, float):
                    self.problems.append(f"{self.path}: sample {seq} is damaged (its time reads as {t!r}: the "
                                         "file was cut short or overwritten there): skipped")
                    continue
                if t < last_t:
                    self.problems.append(f"{self.path}: sample {seq} is damaged (its time is before the sample "
                                         "before it): skipped")
                    continue
                self.seqs.append(seq)
                self.times.append(t)
                last_t = t
                if key:
                    self.keys.append(seq)
        except sqlite3.DatabaseError as exc:
            self.problems.append(f"{self.path}: the file ends early or is damaged after {len(self.seqs)} samples "
                                 f"({_one_line(exc)}): the samples before it are read")
        try:
            self.model_ids = {name: mid for mid, name in self.db.execute("SELECT id, name FROM models")}
        except sqlite3.DatabaseError as exc:
            self.model_ids = {}
            self.problems.append(f"{self.path}: its model table is unreadable ({_one_line(exc)}): no page maps")

    def close(self) -> None:
        self.db.close()

    def _note(self, line: str) -> None:
        if line not in self.problems:
            self.problems.append(line)

    # -- counters --------------------------------------------------------------------------------

    def _rows(self, first: int, last: int) -> Iterator[tuple[int, float, int, Any, bytes]]:
        """Samples ``first..last`` decoded, in order; stops before a damaged or missing one (noted)."""
        expected = first
        try:
            cursor = self.db.execute("SELECT seq, t, key, payload, crc FROM samples WHERE seq BETWEEN ? AND ? "
                                     "ORDER BY seq", (first, last))
            for seq, t, key, payload, stored in cursor:
                if seq != expected:
                    self._note(f"{self.path}: sample {expected} is missing: the moments after it until the next "
                               "key sample show the one before it")
                    return
                if not isinstance(payload, bytes) or crc(payload) != stored:
                    self._note(f"{self.path}: sample {seq} is damaged (CRC mismatch): skipped")
                    return
                try:
                    value, pages = codec.unpack_sample(payload, self.zdict)
                except Damaged as exc:
                    self._note(f"{self.path}: sample {seq} is damaged ({exc}): skipped")
                    return
                yield seq, float(t), int(key), value, pages
                expected += 1
        except sqlite3.DatabaseError as exc:
            self._note(f"{self.path}: unreadable after sample {expected - 1} ({_one_line(exc)})")

    def _step(self, state: _State | None, row: tuple[int, float, int, Any, bytes], follow: str | None) -> _State:
        seq, t, key, value, pages = row
        if not isinstance(value, dict):
            raise Damaged("a sample that is no object")
        if key:
            state = _State(seq, t, [], {}, {}, follow, None)
        elif state is None:
            raise Damaged("a delta sample without its key sample")
        else:
            state = _State(seq, t, state.order, dict(state.models), state.frame, state.followed, state.map)
        order = value.get("o", state.order)
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
            raise Damaged("a model order that is no list of names")
        changes = value.get("m", {})
        if not isinstance(changes, dict):
            raise Damaged("model changes that are no object")
        adds = codec.column_changes(order, value["c"]) if "c" in value else {}
        models = {}
        for name in order:
            flat = codec.apply(state.models.get(name, {}), changes.get(name, {}))
            models[name] = codec.apply(flat, adds[name]) if name in adds else flat
        state.order, state.models = order, models
        if "f" in value:
            state.frame = codec.apply(state.frame, value["f"])
        if follow is not None:
            self._follow_map(state, value.get("p", []), pages)
        return state

    def _follow_map(self, state: _State, index: Any, pages: bytes) -> None:
        """Apply the sample's page entry of the followed model to its map (None from a damaged entry on)."""
        if not isinstance(index, list):
            raise Damaged("a page index that is no list")
        offset = 0
        for entry in index:
            if not (isinstance(entry, list) and len(entry) == 3 and type(entry[2]) is int and entry[2] >= 0):
                raise Damaged("a page entry that is no [name, kind, bytes]")
            name, kind, size = entry
            if name == state.followed:
                data = pages[offset:offset + size]
                if len(data) != size:
                    raise Damaged("a page entry past the payload's end")
                try:
                    state.map = codec.apply_map(state.map, kind, data)
                except Damaged as exc:
                    if state.map is not None or kind == codec.MAP_WHOLE:
                        self._note(f"{self.path}: the page map of {name} at sample {state.seq} cannot be rebuilt "
                                   f"({exc})")
                    state.map = None
                return
            offset += size

    def state_at(self, seq: int, follow: str | None = None) -> _State | None:
        """The sample ``seq`` rebuilt (with ``follow``'s page map), or the last sample before it that can be;
        None when none can."""
        while seq >= 0:
            k = bisect.bisect_right(self.keys, seq) - 1
            if k < 0:
                return None
            key_seq = self.keys[k]
            usable = [c for c in self._cache.values()
                      if key_seq <= c.seq <= seq and (follow is None or c.followed == follow)]
            state = max(usable, key=lambda c: c.seq) if usable else None  # one following a model serves all
            start = state.seq + 1 if state is not None else key_seq
            if state is not None and state.seq == seq:
                return state
            for row in self._rows(start, seq):
                try:
                    state = self._step(state, row, follow if state is None else state.followed)
                except Damaged as exc:
                    self._note(f"{self.path}: sample {row[0]} is damaged ({exc}): skipped")
                    break
            if state is not None:
                self._remember(state)
                return state
            seq = key_seq - 1  # the key sample itself is unreadable: the moment before it
        return None

    def states(self, first: int, last: int) -> Iterator[_State]:
        """Every sample ``first..last`` that can be rebuilt, in order (past a damaged row: from the next key);
        no page map followed."""
        state = self.state_at(first)
        if state is not None and state.seq == first:
            yield state
            seq = first + 1
        else:
            state, seq = None, self._next_key(first, last)
        while seq <= last:
            for row in self._rows(seq, last):
                try:
                    state = self._step(state, row, None)
                except Damaged as exc:
                    self._note(f"{self.path}: sample {row[0]} is damaged ({exc}): skipped")
                    break
                seq = row[0] + 1
                yield state
            if seq > last:
                return
            state, seq = None, self._next_key(seq, last)  # seq could not be read: on from the next key

    def _next_key(self, after: int, last: int) -> int:
        """The first key sample after ``after``; ``last + 1`` when there is none up to ``last``."""
        k = bisect.bisect_right(self.keys, after)
        return self.keys[k] if k < len(self.keys) and self.keys[k] <= last else last + 1


def _gpu(d: dict) -> GpuInfo:
    procs = {int(pid): used for pid, used in (d.get("processes") or {}).items()}
    return GpuInfo(d["index"], d["name"], d["uuid"], d["total_bytes"], d["used_bytes"], d["free_bytes"], procs)


def _followed_pages(day: _Day, state: _State) -> array | None:
    """The followed model's page map at ``state``, checked against the sample's count of words."""
    name = state.followed
    if name is None or name not in state.models:
        return None
    expected = state.models[name].get(PAGES_KEY)
    if type(expected) is not int:
        return None
    data = state.map
    if data is None:
        day._note(f"{day.path}: the page map of {name} at sample {state.seq} cannot be rebuilt (no map before it)")
        return None
    if len(data) != 4 * expected:
        day._note(f"{day.path}: the page map of {name} at sample {state.seq} cannot be rebuilt (it does not "
                  "rebuild to what was recorded)")
        return None
    return codec.map_of(data)


def frame_of(state: _State, selected: str | None, detail_pages: array | None) -> Frame:
    """The kvtop frame a rebuilt sample shows; raises Damaged where its records are not snapshots."""
    models = []
    detail = None
    base = state.base
    for name in state.order:
        flat = state.models[name]
        snap = codec.snapshot_of(flat, base)
        models.append(snap)
        if name == selected:
            detail = codec.snapshot_of(flat, base, detail_pages) if detail_pages is not None else snap
    f = state.frame
    try:
        problems = tuple(Problem(**p) for p in f.get("problems", ()))
        gpus = tuple(_gpu(g) for g in f.get("gpus", ()))
        return Frame(tuple(models), problems, gpus, str(f.get("gpu_note", "")), int(f.get("host_capacity", 0)),
                     detail, state.t, str(f.get("host", "")), 0.0, str(f.get("directory_problem", "")),
                     dict(f.get("router") or {}))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise Damaged(f"frame fields that are not kvtop's: {exc}") from None


class Recording:
    """A recording: one day file or a directory of them, read-only."""

    def __init__(self, days: list[_Day], problems: list[str]) -> None:
        self._days = days
        self._problems = problems
        self._offsets = []
        n = 0
        for day in days:
            self._offsets.append(n)
            n += len(day.times)
        self._times = array("d")
        for day in days:
            self._times.extend(day.times)
        self.start = self._times[0]
        self.end = self._times[-1]

    @classmethod
    def open(cls, path: Path) -> Recording:
        """Open a day file or a directory of day files; raises RecordingError (one line) when it cannot."""
        path = Path(path)
        problems: list[str] = []
        if path.is_dir():
            try:
                files = day_files(path)
            except OSError as exc:
                raise RecordingError(f"{path}: unreadable: {_one_line(exc)}") from None
            if not files:
                raise RecordingError(f"{path}: no recording here (no kvrecord-YYYY-MM-DD.sqlite file)")
        elif path.exists():
            files = [path]
        else:
            raise RecordingError(f"{path}: no such file or directory")
        days: list[_Day] = []
        try:
            for file in files:
                try:
                    day = _Day(file)
                except RecordingError as exc:
                    if len(files) == 1:
                        raise
                    problems.append(f"{exc}: skipped")
                    continue
                if len(day.times) == 0:
                    problems.append(f"{file}: no sample in it: skipped")
                    problems.extend(day.problems)
                    day.close()
                    continue
                if days and day.times[0] <= days[-1].times[-1]:
                    problems.append(f"{file}: overlaps the day file before it: skipped")
                    day.close()
                    continue
                days.append(day)
        except BaseException:
            for day in days:
                day.close()
            raise
        if not days:
            raise RecordingError(f"{path}: no readable sample in this recording"
                                 + (f" ({problems[0]})" if problems else ""))
        return cls(days, problems)

    @property
    def problems(self) -> list[str]:
        """Damaged rows skipped, a file that ends early: one line each, in the order they were found."""
        out = list(self._problems)
        for day in self._days:
            out.extend(p for p in day.problems if p not in out)
        return out

    def times(self) -> Sequence[float]:
        return self._times

    def _locate(self, t: float) -> tuple[_Day, int]:
        i = max(0, bisect.bisect_right(self._times, t) - 1)  # before the first sample: the first
        d = bisect.bisect_right(self._offsets, i) - 1
        day = self._days[d]
        return day, day.seqs[i - self._offsets[d]]

    def frame_at(self, t: float, selected: str | None) -> Frame:
        """The last sample at or before ``t`` (the first, before the recording began), as kvtop showed it,
        with ``selected``'s page map; raises RecordingError when no moment up to ``t`` can be rebuilt."""
        day, seq = self._locate(t)
        d = self._days.index(day)
        while True:
            state = day.state_at(seq, selected)
            if state is not None:
                try:
                    return frame_of(state, selected, _followed_pages(day, state))
                except Damaged as exc:
                    day._note(f"{day.path}: sample {state.seq} is damaged ({exc}): skipped")
                    seq = state.seq - 1
                    day.forget()
                    if seq >= 0:
                        continue
            if d == 0:
                raise RecordingError(f"no moment up to {t:.3f} can be rebuilt: {'; '.join(self.problems[:1])}")
            d -= 1
            day = self._days[d]
            seq = day.seqs[-1]

    def events(self, t0: float, t1: float) -> list[RecordedEvent]:
        """The events recorded from ``t0`` to ``t1`` (both included), oldest first."""
        out: list[RecordedEvent] = []
        for day in self._days:
            if day.times[-1] < t0 - 1 or day.times[0] > t1 + 1:
                continue
            out.extend(self._query_events(day, "t >= ? AND t <= ?", (t0, t1), None))
        return out

    def next_event_after(self, t: float, kinds: Collection[str] | None = None) -> RecordedEvent | None:
        """The first event after ``t`` (of ``kinds``, when given)."""
        for day in self._days:
            if day.times[-1] < t - 1:
                continue
            found = self._query_events(day, "t > ?", (t,), kinds, limit=1)
            if found:
                return found[0]
        return None

    @staticmethod
    def _query_events(day: _Day, where: str, args: tuple, kinds: Collection[str] | None,
                      limit: int | None = None) -> list[RecordedEvent]:
        sql = f"SELECT seq, t, kind, model, level, text, crc FROM events WHERE {where}"
        params: list[Any] = list(args)
        if kinds is not None:
            kinds = list(kinds)
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            params.extend(kinds)
        sql += " ORDER BY t, id"
        out: list[RecordedEvent] = []
        try:
            for seq, at, kind, model, level, text, stored in day.db.execute(sql, params):
                try:
                    ok = crc(event_crc_input(seq, at, kind, model, level, text)) == stored
                except (TypeError, AttributeError):
                    ok = False
                if not ok:
                    day._note(f"{day.path}: an event of sample {seq} is damaged (CRC mismatch): skipped")
                    continue
                out.append(RecordedEvent(at, kind, model, text, level))
                if limit is not None and len(out) >= limit:
                    break
        except sqlite3.DatabaseError as exc:
            day._note(f"{day.path}: its events are unreadable after {len(out)} ({_one_line(exc)})")
        return out

    def models(self) -> list[str]:
        """Every model the recording saw, sorted."""
        names: set[str] = set()
        for day in self._days:
            names.update(day.model_ids)
        return sorted(names)

    def _states(self, t0: float, t1: float) -> Iterator[tuple[_Day, _State]]:
        for day in self._days:
            i0 = bisect.bisect_left(day.times, t0)
            i1 = bisect.bisect_right(day.times, t1) - 1
            if i0 <= i1:
                for state in day.states(day.seqs[i0], day.seqs[i1]):
                    yield day, state

    def samples(self, t0: float = float("-inf"), t1: float = float("inf"),
                models: Collection[str] | None = None) -> Iterator[tuple[float, dict[str, ModelSnapshot]]]:
        """Every sample from ``t0`` to ``t1``: its time and the counters (no page map) of every model listed in
        it (of ``models``, when given), each sample decoded once."""
        for day, state in self._states(t0, t1):
            base = state.base
            out: dict[str, ModelSnapshot] = {}
            for name in state.order:
                if models is not None and name not in models:
                    continue
                try:
                    out[name] = codec.snapshot_of(state.models[name], base)
                except Damaged as exc:
                    day._note(f"{day.path}: {name} at sample {state.seq} is damaged ({exc}): skipped")
            yield state.t, out

    def samples_of(self, model: str, t0: float = float("-inf"), t1: float = float("inf")
                   ) -> Iterator[tuple[float, ModelSnapshot]]:
        """The model's counters (no page map) at every sample from ``t0`` to ``t1`` where it was listed."""
        for t, models in self.samples(t0, t1, (model,)):
            if model in models:
                yield t, models[model]

    def close(self) -> None:
        for day in self._days:
            day.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
