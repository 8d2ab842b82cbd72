"""The recorder: reads every model on the host (counters and page maps) and writes one sample per call.

:meth:`Recorder.read` takes a frame (every model with its page map, the GPUs, the router's figures);
:meth:`Recorder.write` stores it as one transaction: the sample row (every model's changed counters and
page maps in one payload) and the events kvtop's log shows between it and the sample before
(``kvtop.frames.events.diff``, the same code).
A write that fails (a full disk, an I/O error) raises :class:`RecordWriteError`; what was committed
before stays readable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import kvcached_core as kc
from kvcached_core import ModelSnapshot, nvml
from kvcached_core.settings import ConfigError, settings, shm_dir_problem
from kvtop.frames import events as E
from kvtop.frames.source import Frame
from kvtop.record import codec, reading
from kvtop.record.codec import PAGES_KEY, Flat
from kvtop.record.retention import drop_oldest
from kvtop.record.schema import KEY_EVERY, crc, create, day_path, event_crc_input

_KINDS = {"watching": reading.START, "appeared": reading.APPEARED, "stale": reading.STALE,
          "live": reading.LIVE, "late": reading.LATE, "disappeared": reading.GONE, "gave": reading.RECLAIM,
          "policy": reading.POLICY, "sleep": reading.SLEEP, "wake": reading.WAKE, "trimmed": reading.TRIM,
          "problem": reading.PROBLEM}
_LIMIT_KINDS = {"applied": reading.LIMIT_APPLIED, "deferred": reading.LIMIT_DEFERRED,
                "conflict": reading.LIMIT_CONFLICT}


class RecordWriteError(Exception):
    """The recording could not be written (one line: the file and why)."""


def event_kind(event: E.Event, models: dict[str, ModelSnapshot]) -> str:
    """A kvtop event's recorded kind: a limit's is named by the status the model shows with it."""
    if event.kind == "limit":
        m = models.get(event.model)
        if m is not None and not m.legacy:
            return _LIMIT_KINDS.get(m.limit_status, reading.LIMIT)
        return reading.LIMIT
    return _KINDS.get(event.kind, event.kind)


def frame_record(frame: Frame) -> dict[str, Any]:
    """The frame's fields beside its models, as JSON values."""
    return {"gpus": [dataclasses.asdict(g) for g in frame.gpus], "gpu_note": frame.gpu_note,
            "host_capacity": frame.host_capacity, "host": frame.host,
            "directory_problem": frame.directory_problem, "router": frame.router,
            "problems": [dataclasses.asdict(p) for p in frame.problems]}


class Recorder:
    """Writes samples into ``directory``'s day files; ``max_size``: drop the oldest days beyond it."""

    def __init__(self, directory: Path, *, interval: float = 1.0, max_size: int | None = None,
                 key_every: int = KEY_EVERY, segments: Path | None = None, gpus: bool = True) -> None:
        self.directory = directory
        self.interval = interval
        self.max_size = max_size
        self.key_every = key_every
        self.segments = segments
        self.gpus = gpus
        self.host = socket.gethostname()
        self.dropped: list[Path] = []  # day files dropped for max_size
        self._db: sqlite3.Connection | None = None
        self._path: Path | None = None
        self._seq = 0
        self._last_t = float("-inf")
        self._flats: dict[str, Flat] = {}
        self._order: list[str] = []
        self._frame: dict[str, Any] = {}
        self._maps: dict[str, bytes] = {}
        self._model_ids: dict[str, int] = {}
        self._zdict = codec.ZDICT.encode()
        self._prev_models: tuple[ModelSnapshot, ...] | None = None
        self._prev_problems: tuple[kc.Problem, ...] = ()
        try:
            self._host_capacity = settings().host_capacity_bytes
        except ConfigError:
            self._host_capacity = 0

    @property
    def path(self) -> Path | None:
        """The day file written now (None before the first sample)."""
        return self._path

    def read(self) -> Frame:
        """Every model on the host with its page map (our segments and the public kvcached's rows)."""
        started = time.perf_counter()
        found = kc.scan(with_pages=True, directory=self.segments)
        gpus = tuple(nvml.probe(None)) if self.gpus else ()
        note = "" if gpus else (nvml.unavailable_reason() if self.gpus and not nvml.available() else "")
        from kvtop.serve.router.published import read as read_routers

        router = read_routers(self.segments or settings().shm_dir).models
        return Frame(found.models, found.problems, gpus, note, self._host_capacity, None, time.time(), self.host,
                     time.perf_counter() - started, shm_dir_problem(self.segments) or "", router)

    def write(self, frame: Frame) -> float:
        """Store ``frame`` as the next sample; returns its time (``frame.taken_at``, kept increasing)."""
        t = max(frame.taken_at, self._last_t + 1e-6)
        try:
            self._open_for(t)
            self._write(frame, t)
        except (sqlite3.Error, OSError) as exc:
            where = self._path or day_path(self.directory, t)
            raise RecordWriteError(f"{where}: cannot write: {' '.join(str(exc).split())}") from None
        self._last_t = t
        return t

    def _open_for(self, t: float) -> None:
        path = day_path(self.directory, t)
        if path == self._path and self._db is not None:
            return
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._db = create(path, {"created": repr(t), "host": self.host, "interval_s": repr(self.interval),
                                 "key_every": str(self.key_every), "kvtop_version": kc.__version__,
                                 "zdict": codec.ZDICT})
        self._path = path
        self._zdict = str(self._db.execute("SELECT value FROM meta WHERE key = 'zdict'").fetchone()[0]).encode()
        row = self._db.execute("SELECT max(seq) FROM samples").fetchone()
        self._seq = 0 if row[0] is None else row[0] + 1
        self._model_ids = {name: mid for mid, name in self._db.execute("SELECT id, name FROM models")}
        self._flats, self._order, self._frame, self._maps = {}, [], {}, {}  # a new file starts with a key sample
        self._trim_days()

    def _trim_days(self) -> None:
        if self.max_size is not None:
            self.dropped.extend(drop_oldest(self.directory, self.max_size, keep=self._path))

    def _write(self, frame: Frame, t: float) -> None:
        db = self._db
        assert db is not None
        seq = self._seq
        key = seq % self.key_every == 0 or not self._flats and not self._order
        base = codec.time_base(t)
        flats: dict[str, Flat] = {}
        maps: dict[str, bytes] = {}
        page_index: list[list] = []  # [name, kind, bytes] of each map in the payload, in its order
        page_data: list[bytes] = []
        for m in frame.models:
            flat = codec.relative(codec.flatten(m.to_record()), base)
            if m.pages is not None:
                data = codec.map_bytes(m.pages)
                flat[PAGES_KEY] = len(m.pages)
                before = self._maps.get(m.name)
                changed = None
                if not key and before is not None and len(before) == len(data):
                    changed = codec.changed_words(before, data)
                    if len(changed) > len(m.pages) // 4:  # most of it: written whole (smaller, faster to read)
                        changed = None
                if changed is None:
                    kind, blob = codec.MAP_WHOLE, codec.whole_map(data)
                elif changed:
                    kind, blob = codec.MAP_CHANGES, codec.map_changes(before or b"", data, changed)
                else:
                    blob = b""
                if blob:
                    page_index.append([m.name, kind, len(blob)])
                    page_data.append(blob)
                maps[m.name] = data
            else:
                flat[PAGES_KEY] = None
                if m.name in self._maps and not key:  # a key sample's maps are all written whole
                    maps[m.name] = self._maps[m.name]  # unread this instant: later changes go on from the last map
            flats[m.name] = flat
        order = [m.name for m in frame.models]
        record = frame_record(frame)
        payload: dict[str, Any] = {}
        if key:
            payload = {"o": order, "m": {n: codec.changes({}, f) for n, f in flats.items()},
                       "f": codec.changes({}, record)}
        else:
            if order != self._order:
                payload["o"] = order
            changed_models = {}
            for name, flat in flats.items():
                change = codec.changes(self._flats.get(name, {}), flat)
                if change:
                    changed_models[name] = change
            payload.update(codec.columns(order, changed_models))
            frame_change = codec.changes(self._frame, record)
            if frame_change:
                payload["f"] = frame_change
        if page_index:
            payload["p"] = page_index
        blob = codec.pack_sample(payload, b"".join(page_data), key, self._zdict)
        events = E.diff(self._prev_models, frame.models, t, self._prev_problems, frame.problems)
        by_name = {m.name: m for m in frame.models}
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT INTO samples (seq, t, key, payload, crc) VALUES (?, ?, ?, ?, ?)",
                       (seq, t, int(key), blob, crc(blob)))
            for m in frame.models:
                self._model_id(m.name)
            for e in events:
                what = event_kind(e, by_name)
                db.execute("INSERT INTO events (seq, t, kind, model, level, text, crc) VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (seq, t, what, e.model, e.level, e.text,
                            crc(event_crc_input(seq, t, what, e.model, e.level, e.text))))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            self._model_ids = {name: mid for mid, name in db.execute("SELECT id, name FROM models")}
            raise
        self._seq = seq + 1
        self._flats, self._order, self._frame, self._maps = flats, order, record, maps
        self._prev_models, self._prev_problems = frame.models, frame.problems
        if key and seq:
            self._trim_days()

    def _model_id(self, name: str) -> int:
        mid = self._model_ids.get(name)
        if mid is None:
            assert self._db is not None
            cursor = self._db.execute("INSERT INTO models (name) VALUES (?)", (name,))
            mid = self._model_ids[name] = int(cursor.lastrowid or 0)
        return mid

    def close(self) -> None:
        """Commit nothing more and close the day file (its WAL folded into it)."""
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(sqlite3.Error):  # a full disk: the WAL stays beside the file; readers read it
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.close()
