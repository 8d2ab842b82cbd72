"""The recording's file: SQLite (WAL), one file per UTC day, every row's payload checked by a CRC32.

docs/record.md documents the tables, the encodings and example queries. A sample is one row of
``samples``: every model's counters and page map, a key sample whole, the others only what changed since
the sample before, in one compressed payload (``kvtop.record.codec``). Every ``KEY_EVERY`` samples (and at
a day file's first) a key sample, so any moment rebuilds from at most ``KEY_EVERY`` rows.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
import zlib
from pathlib import Path

SCHEMA_VERSION = 2  # 2: one row per sample with every model's page map in it (1: a pages table)
APPLICATION_ID = 0x6B767263  # "kvrc" in the SQLite header: a recording is known before any table is read
PAGE_SIZE = 16384  # SQLite's page on a new file: a 4 KiB page left ~17 % of it unused beside ~1 KB rows
KEY_EVERY = 300  # samples between key samples (counters and page maps written whole): benchmarks/record_cost.py
FILE_PREFIX, FILE_SUFFIX = "kvrecord-", ".sqlite"
DAY_FILE = re.compile(r"^kvrecord-(\d{4}-\d{2}-\d{2})\.sqlite$")

TABLES = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS samples (
    seq     INTEGER PRIMARY KEY,   -- 0, 1, 2 ... within this file
    t       REAL NOT NULL,         -- wall-clock seconds (Unix time) the sample was read
    key     INTEGER NOT NULL,      -- 1: every model written whole, 0: only what changed since seq - 1
    payload BLOB NOT NULL,         -- compressed JSON and page maps, see docs/record.md
    crc     INTEGER NOT NULL       -- zlib.crc32(payload)
);
CREATE INDEX IF NOT EXISTS samples_t ON samples (t);
CREATE TABLE IF NOT EXISTS models (
    id   INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS events (
    id    INTEGER PRIMARY KEY,
    seq   INTEGER NOT NULL,        -- samples.seq of the sample that showed it
    t     REAL NOT NULL,
    kind  TEXT NOT NULL,           -- kvtop.record.reading's event kinds
    model TEXT NOT NULL,
    level TEXT NOT NULL,           -- info, good, warn, error (kvtop's event log colours)
    text  TEXT NOT NULL,
    crc   INTEGER NOT NULL         -- zlib.crc32 of event_crc_input(...)
);
CREATE INDEX IF NOT EXISTS events_t ON events (t);
"""


def day_of(t: float) -> str:
    """The UTC day a sample taken at ``t`` belongs to: ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def day_path(directory: Path, t: float) -> Path:
    return directory / f"{FILE_PREFIX}{day_of(t)}{FILE_SUFFIX}"


def day_files(directory: Path) -> list[Path]:
    """The directory's day files, oldest first (by the day in their names)."""
    found = []
    for entry in directory.iterdir():
        if DAY_FILE.match(entry.name) and entry.is_file():
            found.append(entry)
    return sorted(found, key=lambda p: p.name)


def crc(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def event_crc_input(seq: int, t: float, kind: str, model: str, level: str, text: str) -> bytes:
    return "\x1f".join((str(seq), repr(t), kind, model, level, text)).encode("utf-8", "surrogateescape")


def create(path: Path, meta: dict[str, str]) -> sqlite3.Connection:
    """Open (creating it if new, owner-only) a day file for writing: WAL, the tables, ``meta`` on a new file."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))  # its WAL takes the same mode
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # only a new file takes it (before WAL writes its header)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses at most the last commits, never the file
    existing = db.execute("PRAGMA application_id").fetchone()[0]
    if existing not in (0, APPLICATION_ID):
        db.close()
        raise sqlite3.DatabaseError(f"{path} is an SQLite file of another application")
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        for statement in TABLES.split(";"):
            if statement.strip():
                db.execute(statement)
        for key, value in {"schema_version": str(SCHEMA_VERSION), **meta}.items():
            db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
        version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        if version != str(SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"{path} is a recording of schema {version} (this kvctl record writes "
                                        f"{SCHEMA_VERSION}): move it aside to record today")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        db.close()
        raise
    return db


def open_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection: reading never checkpoints, truncates or removes anything beside the file."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                         check_same_thread=False)
    db.text_factory = lambda raw: raw.decode("utf-8", "replace")  # forged text never raises mid-query
    return db
