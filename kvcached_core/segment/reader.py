"""Discover and read segments without locks: list_models(), snapshot(), scan().

A dashboard scans the same files again and again, so :func:`scan` keeps the files it read open
until the next scan (:class:`_KeptFiles`): a file is read again through the descriptor it was
opened with only while the directory still lists its name with the same inode (an inode we hold
open cannot be reused by another file), and every read still copies the bytes and checks the
header, the seqlock and both sums. A segment is never mapped: a writer that truncates its file
would kill a mapping reader with SIGBUS.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..settings import settings
from . import layout as L
from . import liveness, stuck
from .liveness import AliveCheck, AliveMemo, judge, writer_alive
from .names import SEGMENT_PREFIX, InvalidName, segment_path
from .pgroups import GroupJudge
from .procinfo import is_alive
from .sealed import Words, read_words
from .snapshot import ModelSnapshot, Problem, RankInfo, Scan, Traffic, model_from_fields

HEARTBEAT_STALE_S = liveness.HEARTBEAT_STALE_S
READ_RETRIES = 32
DEAD_WRITER_CHECK = 12  # odd-sequence attempts (~8 ms) before asking whether the writer still lives
BUSY_RETRIES = 5  # exact reads snapshot() makes while the writer is too busy for a consistent copy
SWAP_RETRIES = 3  # scans snapshot() makes while the file it found keeps vanishing before it is read
QUIET_FAILURES = 3  # failed checks of an unchanging copy before the file is called corrupt
MAX_PAGES = L.MAX_PAGES  # more is a damaged (or forged) header
MAX_KEPT_OPEN = 256  # files a scan keeps open for the next one; past this many, the rest are opened each time


class ModelNotFound(LookupError):
    """No model matches; ``candidates`` holds the names that exist (or that matched ambiguously)."""

    def __init__(self, message: str, candidates: list[str]) -> None:
        super().__init__(message)
        self.candidates = candidates


class SegmentCorrupt(ValueError):
    """A file in our namespace that does not hold a valid segment."""


class PublishUnfinished(SegmentCorrupt):
    """The sequence stayed odd: the writer stopped (or died) in the middle of a publish; ``raw``: the last copy."""

    def __init__(self, message: str, raw: bytes = b"") -> None:
        super().__init__(message)
        self.raw = raw


class HeaderOverwritten(SegmentCorrupt):
    """Our segment with its first 8 bytes replaced (the public kvctl limit writes its total there)."""

    def __init__(self, message: str, writer_alive: bool) -> None:
        super().__init__(message)
        self.writer_alive = writer_alive


def _overwritten(raw: bytes) -> HeaderOverwritten | None:
    """Our header but for the magic: what the public ``kvctl limit <our file>`` leaves behind."""
    if len(raw) < L.HEADER.size:
        return None
    fields = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0), strict=False))
    if (fields["layout_version"], fields["header_bytes"]) != (L.LAYOUT_VERSION, L.HEADER_SIZE) \
            or fields["total_bytes"] != L.total_size(fields["pages_total"], fields["ranks_max"]):
        return None
    alive = writer_alive(fields, raw)
    return HeaderOverwritten(
        f"header overwritten: its first 8 bytes hold {L.I64.unpack_from(raw, 0)[0]} where the magic belongs "
        f"(the public kvctl limit writes its total there); writer pid {fields['pid']} "
        + ("still runs and restores it" if alive else "is gone"), alive)


def parse_header(raw: bytes) -> dict:
    if not raw.strip(b"\0"):
        raise SegmentCorrupt("empty header (being created, or never written)")
    if raw[:8] != L.MAGIC:
        raise _overwritten(raw) or SegmentCorrupt("bad magic: not a kvcached_core segment")
    if len(raw) < L.HEADER.size:
        raise SegmentCorrupt(f"truncated header ({len(raw)} bytes)")
    fields = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0), strict=False))
    if fields["layout_version"] != L.LAYOUT_VERSION:
        raise SegmentCorrupt(f"layout version {fields['layout_version']} (this reader knows {L.LAYOUT_VERSION})")
    pages, ranks = fields["pages_total"], fields["ranks_max"]
    if pages > MAX_PAGES or ranks > 4096 or fields["header_bytes"] != L.HEADER_SIZE:
        raise SegmentCorrupt("implausible sizes in header")
    if fields["total_bytes"] != L.total_size(pages, ranks):
        raise SegmentCorrupt("header sizes disagree")
    if fields["blocks_per_page"] > L.MAX_BLOCKS_PER_PAGE or fields["blocks_per_page"] <= 0:
        raise SegmentCorrupt("implausible blocks per page")
    for key in ("name", "model", "engine", "backend"):
        fields[key] = L.decode_text(fields[key])
    return fields


def _backoff(attempt: int) -> None:
    """Spin a few times, then sleep longer and longer (up to ~0.4 s in all): a Python writer
    preempted inside its publish window (GIL switch, a busy CPU) can hold it for milliseconds."""
    time.sleep(0 if attempt < 8 else min(0.0005 * 2 ** (attempt - 8), 0.02))


_SUMS: dict[str, tuple[bytes, list[int]]] = {}  # per segment name: the last page map summed, its parts' sums
_SUMS_MAX = 4096
SUM_PART = 1024  # bytes of page map (256 entries) summed apart: a publish changes a few entries, not all


def page_sum(name: str, map_raw: bytes, pages: array) -> int:
    """The page map's sum mod 2**64, as the writer keeps it in ``page_sum``.

    A map byte-identical to the last one summed for ``name`` costs one compare instead of a sum
    over every page: between publishes (most reads of a dashboard) nothing is recomputed. A map
    that changed is summed again only in its parts of :data:`SUM_PART` bytes that changed.
    """
    last = _SUMS.get(name)
    if last is not None and last[0] == map_raw:
        return sum(last[1]) & 0xFFFFFFFFFFFFFFFF
    if last is None or len(last[0]) != len(map_raw):
        parts = [sum(pages[i:i + SUM_PART // 4]) for i in range(0, len(pages), SUM_PART // 4)]
    else:
        before, parts = last[0], last[1].copy()
        for k, off in enumerate(range(0, len(map_raw), SUM_PART)):
            if map_raw[off:off + SUM_PART] != before[off:off + SUM_PART]:
                parts[k] = sum(pages[off // 4:(off + SUM_PART) // 4])
    if len(_SUMS) >= _SUMS_MAX:
        _SUMS.clear()
    _SUMS[name] = (map_raw, parts)
    return sum(parts) & 0xFFFFFFFFFFFFFFFF


class _HeaderChanged(Exception):
    """The header in the file is no longer the one parsed: parse it again."""


def _consistent_copy(fd: int, header: dict, with_pages: bool,
                     kept: _Open | None = None, stuck_seq: int = -1) -> tuple[dict, array | None, bytes, Words]:
    """Copy counters (and the page map) until one copy passes the seqlock and both checksums, and its
    sealed blocks (COMPACT, TRAFFIC, SLEEP) their own (see :func:`.sealed.read_words`).

    With ``kept`` (a file kept open since its header was parsed), a copy whose header differs
    raises :class:`_HeaderChanged` (the file may have been written over since), and counters
    byte-identical to the last ones checked for it (sequence and checksum included) are not
    checked and decoded again. A first copy whose sequence is ``stuck_seq`` (the odd one its writer
    was found stopped at by an earlier read) raises :class:`PublishUnfinished` at once.
    """
    header_raw = kept.header_raw if kept is not None else None
    pages_total = header["pages_total"]
    size = L.total_size(pages_total, header["ranks_max"])
    end = size if with_pages else L.PAGE_MAP_OFF
    seqs_seen: set[int] = set()
    quiet_failures, failed_seq = 0, -1
    doubts, doubted = 0, b""
    for attempt in range(READ_RETRIES):
        raw = os.pread(fd, end, 0)
        if len(raw) < end:
            raise SegmentCorrupt("file shorter than its header says" if attempt == 0 else "file shrank while reading")
        if header_raw is not None:
            if raw[:L.HEADER.size] != header_raw:
                raise _HeaderChanged
            header_raw = None  # once per read: the writer never rewrites it
        seq = L.U64.unpack_from(raw, L.SEQ_OFF)[0]
        seqs_seen.add(seq)
        if seq & 1:
            if (seq == stuck_seq and attempt == 0) or \
                    (attempt == DEAD_WRITER_CHECK and seqs_seen == {seq} and not writer_alive(header, raw)):
                raise PublishUnfinished(f"a publish never finished (sequence {seq} stayed odd)", raw)
            _backoff(attempt)
            continue
        if os.pread(fd, 8, L.SEQ_OFF) != raw[L.SEQ_OFF:L.SEQ_OFF + 8]:
            _backoff(attempt)  # the writer moved on during the copy: check again right away, no work wasted
            continue
        # The sequence was even and unchanged around the copy: verify it (on weakly ordered CPUs too).
        region = raw[L.SEQ_OFF:L.CHECKSUM_OFF + 8]
        pages = None
        if kept is not None and kept.counted is not None and kept.counted[0] == region:
            counters = kept.counted[1]  # these very bytes passed the checksum before
        elif seq == 0:  # never published yet: all zeros
            counters = _unpublished_counters()
        elif L.U64.unpack_from(raw, L.CHECKSUM_OFF)[0] != L.counters_checksum(raw[L.COUNTERS_OFF:L.CHECKSUM_OFF], seq):
            counters = None
        else:
            counters = dict(zip(L.COUNTER_FIELDS, L.COUNTERS.unpack_from(raw, L.COUNTERS_OFF), strict=False))
            if kept is not None:
                kept.counted = (region, counters)
        if counters is not None and with_pages:
            map_raw = raw[L.PAGE_MAP_OFF:L.PAGE_MAP_OFF + 4 * pages_total]
            pages = array("I")
            pages.frombytes(map_raw)
            if page_sum(header["name"], map_raw, pages) != counters["page_sum"]:
                counters = None
        if counters is None:
            # Failed copies at one and the same sequence: the writer did not move, the file really holds
            # this. A copy made while it moved can fail although its sequence matched around it (the
            # kernel's copy may load the bytes out of order), so a new sequence starts the count again.
            quiet_failures = quiet_failures + 1 if seq == failed_seq else 1
            failed_seq = seq
            if quiet_failures >= QUIET_FAILURES:
                raise SegmentCorrupt("checksum mismatch in a quiet segment")
            _backoff(attempt)
            continue
        words = read_words(raw, header, counters, kept)
        if not words.whole and attempt < READ_RETRIES - 1:
            # A sealed block mid-write (odd: wait for it, as for the counters), or one that fails its check
            # or a cross-check: read again; the same bytes failing QUIET_FAILURES times are what the file holds.
            same = (raw[L.CONTROL_OFF:L.LIVENESS_OFF] + raw[L.SEQ_OFF:L.SEQ_OFF + 8] + raw[L.WORDS_START:L.WORDS_END]
                    + raw[L.ENDPOINT_OFF:L.HEADER_SIZE] + raw[L.GROUPS_OFF:L.GROUPS_END])
            doubts, doubted = (doubts + 1 if same == doubted else 1), same
            if words.writing or doubts < QUIET_FAILURES:
                _backoff(attempt)
                continue
        return counters, pages, raw, words
    if len(seqs_seen) == 1:  # nobody is writing, yet no copy checks out
        seq = seqs_seen.pop()
        if seq & 1:
            raise PublishUnfinished(f"a publish never finished (sequence {seq} stayed odd)", raw)
        raise SegmentCorrupt("checksum mismatch in a quiet segment")
    raise BlockingIOError("no consistent copy after retries: the writer is very busy")


_unpublished_counters = stuck.unpublished_counters


def _page_map_bytes(fd: int, header: dict) -> bytes:
    return os.pread(fd, 4 * header["pages_total"], L.PAGE_MAP_OFF)


def _rank_bytes(fd: int, header: dict, body: bytes) -> bytes:
    """The RANKS region: from the consistent copy when it holds it, else read under the seqlock (cheap)."""
    off = L.ranks_offset(header["pages_total"])
    size = L.RANK.size * header["ranks_max"]
    if len(body) >= off + size:
        return body[off:off + size]
    raw = b""
    for _ in range(READ_RETRIES):
        before = os.pread(fd, 8, L.SEQ_OFF)
        raw = os.pread(fd, size, off)
        if len(before) == 8 and not before[0] & 1 and os.pread(fd, 8, L.SEQ_OFF) == before:
            break
    return raw


class _Open:
    """A segment file opened for reading, with what its header said once it was checked."""

    __slots__ = ("counted", "dev", "fd", "fields", "header", "header_raw", "ino", "keep", "static", "words")

    def __init__(self, fd: int, ino: int, keep: bool, dev: int = -1) -> None:
        self.fd, self.ino, self.keep, self.dev = fd, ino, keep, dev
        self.header: dict | None = None
        self.header_raw = b""
        self.static: dict = {}  # the snapshot fields the header fixes
        self.counted: tuple[bytes, dict] | None = None  # the last counters region checked, decoded
        self.fields: tuple[dict, dict] | None = None  # the snapshot fields those counters alone fix
        self.words: tuple[bytes, dict, Words] | None = None  # the last sealed blocks decoded (sealed.read_words)

    @classmethod
    def of(cls, path: str | Path, ino: int = -1, dev: int = -1) -> _Open:
        """Open ``path`` (never through a symbolic link); ``keep`` when it is the inode ``ino`` on ``dev``."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SegmentCorrupt("not a regular file: a symbolic link (never followed)") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentCorrupt("not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, st.st_ino, st.st_ino == ino and st.st_dev == dev, st.st_dev)

    @property
    def identity(self) -> tuple[int, int, bytes]:
        """Which file this is, for what a reader remembers of it (segment/stuck.py): device, inode, header bytes."""
        return self.dev, self.ino, self.header_raw

    def check_header(self, path: str) -> dict:
        """Parse and check the header (once; again after :meth:`forget`)."""
        if self.header is None:
            fd = self.fd
            raw = os.pread(fd, L.HEADER.size, 0)
            header = parse_header(raw)
            if os.path.basename(path) != SEGMENT_PREFIX + header["name"]:
                raise SegmentCorrupt(f"the header names segment {header['name']!r}, not this file")
            if os.fstat(fd).st_size < L.total_size(header["pages_total"], header["ranks_max"]):
                raise SegmentCorrupt("file shorter than its header says")
            self.header, self.header_raw = header, raw
            self.static = {
                "name": header["name"], "path": path, "model": header["model"], "engine": header["engine"],
                "backend": header["backend"], "pid": header["pid"], "uid": header["uid"], "device": header["device"],
                "page_size": header["page_size"], "block_bytes": header["block_bytes"],
                "num_layers": header["num_layers"], "num_kv_buffers": header["num_kv_buffers"],
                "blocks_per_page": header["blocks_per_page"], "num_blocks": header["num_blocks"],
                "pages_total": header["pages_total"], "start_time": header["start_time"],
                "pid_ns": header["pid_ns"], "tp_world": header["tp_world"],
                "device_capacity": header["device_capacity"], "legacy_reserved": 0, "legacy": False,
                "device_headroom": _bytes_word(header["device_headroom"]),
            }
        return self.header

    def forget(self) -> None:
        self.header, self.words, self.counted, self.fields = None, None, None, None

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def read_segment(path: Path, *, with_pages: bool = False, now_ns: int | None = None) -> ModelSnapshot:
    """Read one of our segments; raises SegmentCorrupt, BlockingIOError or OSError."""
    file = _Open.of(path)
    try:
        return _read(file, str(path), with_pages, now_ns, is_alive)
    finally:
        file.close()


def _read(file: _Open, path: str, with_pages: bool, now_ns: int | None, alive: AliveCheck) -> ModelSnapshot:
    """One snapshot of the open segment ``file`` (found at ``path``)."""
    fd = file.fd
    fresh = file.header is None
    header = file.check_header(path)
    if not fresh and not with_pages and not os.pread(fd, 1, L.total_size(header["pages_total"], header["ranks_max"]) - 1):
        raise SegmentCorrupt("file shorter than its header says")  # cut since it was kept (a copy with the map sees it)
    now_ns = now_ns or time.time_ns()
    figures_ns = 0  # the figures are this read's
    try:
        # A header parsed just now is compared by the copy only when the file was kept open since.
        counters, pages, body, words = _consistent_copy(fd, header, with_pages, None if fresh else file,
                                                        stuck.stuck_seq(path, file.identity))
        stuck.remember(path, file.identity, counters, pages, words, now_ns)
    except _HeaderChanged:
        file.forget()
        return _read(file, path, with_pages, now_ns, alive)  # parsed afresh: no second comparison
    except PublishUnfinished as exc:
        body = exc.raw
        if writer_alive(header, body):
            # Stopped inside a publish (SIGSTOP, a debugger): it still holds its memory. Its last known figures.
            held = stuck.held(path, file.identity, header, body, with_pages, lambda: _page_map_bytes(fd, header))
            if held is None:
                raise BlockingIOError(f"{exc}: its writer (pid {header['pid']}) is alive but stuck") from None
            counters, pages, words, figures_ns = held.counters, held.pages, held.words, held.figures_ns
        else:
            # The writer died mid-publish: whatever it counted is no longer held. Show it stale and empty.
            counters = _unpublished_counters()
            body = os.pread(fd, L.total_size(header["pages_total"], header["ranks_max"]) if with_pages
                            else L.PAGE_MAP_OFF, 0)
            pages = array("I", bytes(4 * header["pages_total"])) if with_pages else None
            words = read_words(body, header, counters, None)
    rank_raw = _rank_bytes(fd, header, body) if header["tp_world"] > 1 else b""
    control = L.CONTROL.unpack_from(body, L.CONTROL_OFF)  # limit, revision, check, trim_seq
    heartbeat = L.U64.unpack_from(body, L.HEARTBEAT_OFF)[0]
    working = (_bytes_word(L.U64.unpack_from(body, L.WORKING_PEAK_OFF)[0]),
               _bytes_word(L.U64.unpack_from(body, L.WORKING_NOW_OFF)[0]))
    verdict = judge(header["pid"], header["start_time"], header["pid_ns"], heartbeat, now_ns, alive=alive)
    status = "live" if verdict.alive and not counters["closing"] else "stale"
    ranks: tuple[RankInfo, ...] = ()
    if rank_raw:
        found = []
        for i in range(min(counters["ranks_active"], header["ranks_max"], len(rank_raw) // L.RANK.size)):
            r = dict(zip(L.RANK_FIELDS, L.RANK.unpack_from(rank_raw, i * L.RANK.size), strict=False))
            lost = bool(r["flags"] & L.RANK_LOST)
            found.append(RankInfo(r["rank"], r["device"], r["pid"], r["mapped_bytes"],
                                  not lost and alive(r["pid"], r["start_time"], None)))
        ranks = tuple(found)
    # A controller's request not yet applied shows as asked; otherwise what the allocator applied
    # last, which also covers limits the engine set itself with set_limit().
    revision = control[1]
    pending = revision > counters["applied_revision"]
    requested = control[0] if pending else counters["requested_limit"]
    limit_status = L.LIMIT_STATUS_NAMES.get(counters["limit_status"], "unknown")
    if status == "stale" and pending:
        limit_status = "stale"
    values = file.static.copy()
    values.update(_counter_fields(file, counters))
    values.update(
        status=status, limit_status=limit_status, requested_limit=None if requested < 0 else requested,
        limit_revision=revision, trim_seq=control[3], heartbeat_ns=heartbeat, read_ns=now_ns,
        late=status == "live" and (verdict.late or figures_ns != 0), figures_ns=figures_ns, ranks=ranks, pages=pages,
        traffic=None if words.traffic is None else Traffic(*words.traffic, now_ns),
        sleep=words.sleep, compaction=words.compaction, pressure=words.pressure, endpoint=words.endpoint,
        groups=words.groups, working_peak=working[0], working_now=working[1],
    )
    return model_from_fields(values)


def _bytes_word(value: int) -> int:
    """A byte figure an allocator wrote (at most ``layout.MAX_LIMIT_BYTES``); 0 (none) for one no allocator writes."""
    return value if value <= L.MAX_LIMIT_BYTES else 0


def _counter_fields(file: _Open, counters: dict) -> dict:
    """The snapshot fields the counters alone fix; the same dict again while the counters are the same object."""
    if file.fields is not None and file.fields[0] is counters:
        return file.fields[1]
    effective = counters["effective_limit"]
    fields = {
        "pages_inuse": counters["pages_inuse"], "pages_reserved": counters["pages_reserved"],
        "blocks_used": counters["blocks_used"], "blocks_cached": counters["blocks_cached"],
        "mapped_bytes": counters["mapped_bytes"], "limit_bytes": None if effective < 0 else effective,
        "applied_revision": counters["applied_revision"], "trim_ack_seq": counters["trim_ack_seq"],
        "trim_bytes": counters["trim_bytes"], "trimmed_total": counters["trimmed_total"],
        "idle_returned": counters["idle_returned"], "alloc_count": counters["alloc_count"],
        "free_count": counters["free_count"], "alloc_blocks": counters["alloc_blocks"],
        "free_blocks": counters["free_blocks"], "evicted_blocks": counters["evicted_blocks"],
        "updated_ns": counters["updated_ns"],
    }
    file.fields = (counters, fields)
    return fields


class _KeptFiles:
    """The segment files the last scan of a directory read, kept open for the next scan of it.

    Bounded (:data:`MAX_KEPT_OPEN`), one directory at a time (scanning another closes them), and
    a file the directory no longer lists, or lists with another inode, is closed by the scan that
    notices. A scan takes the whole set and gives it back when done, so two threads scanning at
    once never share a descriptor (the second opens its own). A forked child closes its copies.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: tuple[str, int] | None = None
        self._files: dict[str, _Open] = {}

    def take(self, where: tuple[str, int]) -> dict[str, _Open]:
        with self._lock:
            if self._where != where:
                return {}
            files, self._files, self._where = self._files, {}, None
            return files

    def give(self, where: tuple[str, int], files: dict[str, _Open]) -> None:
        with self._lock:
            old, self._files, self._where = self._files, files, where
        _close_all(old)

    def clear(self) -> None:
        self.give(("", -1), {})

    def open_count(self) -> int:
        return len(self._files)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        files, self._files, self._where = self._files, {}, None
        _close_all(files)


def _close_all(files: dict[str, _Open]) -> None:
    for file in files.values():
        file.close()


_KEPT = _KeptFiles()
os.register_at_fork(after_in_child=_KEPT._after_fork)


# Reads a file of the directory that is not one of our segments: its row, a Problem, or None (not such a file).
Foreign = Callable[[str, str, GroupJudge], "ModelSnapshot | Problem | None"]


def scan(*, with_pages: bool = False, directory: Path | None = None, foreign: Foreign | None = None) -> Scan:
    """Every segment in the directory, plus a Problem for each file we could not use.

    ``foreign`` reads the other files (``kvcached_core.fleet`` passes the public kvcached's reader).
    """
    base = directory or settings().shm_dir
    models: list[ModelSnapshot] = []
    problems: list[Problem] = []
    try:
        with os.scandir(base) as listing:
            entries = sorted((entry.name, entry.inode()) for entry in listing)
        where = (os.fspath(base), os.stat(base).st_dev)
    except OSError as exc:
        return Scan((), (Problem(str(base), "unreadable", exc.strerror or str(exc)),))
    prefix = str(base / "_")[:-1]  # pathlib's own join, once: str(base / filename) for every name
    now_ns = time.time_ns()
    alive = AliveMemo()  # one look at /proc per writer process, however many models it runs
    judge = GroupJudge()
    kept = _KEPT.take(where)
    keep: dict[str, _Open] = {}
    try:
        for filename, ino in entries:
            path = prefix + filename
            if filename.startswith(SEGMENT_PREFIX):
                file = kept.pop(filename, None)
                if file is not None and file.ino != ino:  # replaced since: the name holds another file now
                    file.close()
                    file = None
                try:
                    file = file or _Open.of(path, ino, where[1])
                    models.append(_read(file, path, with_pages, now_ns, alive))
                    if file.keep and len(keep) < MAX_KEPT_OPEN:
                        keep[filename], file = file, None
                except HeaderOverwritten as exc:
                    problems.append(Problem(path, "corrupt", str(exc), exc.writer_alive))
                except SegmentCorrupt as exc:
                    kind = "foreign" if "magic" in str(exc) or "regular file" in str(exc) else "corrupt"
                    problems.append(Problem(path, kind, str(exc)))
                except BlockingIOError as exc:
                    problems.append(Problem(path, "busy", str(exc)))
                except FileNotFoundError:
                    continue  # removed while we listed
                except (OSError, ValueError, OverflowError, MemoryError) as exc:
                    problems.append(Problem(path, "unreadable", str(exc)))
                finally:
                    if file is not None:
                        file.close()
            elif foreign is not None and not filename.startswith("."):
                row = foreign(filename, path, judge)
                if isinstance(row, ModelSnapshot):
                    models.append(row)
                elif row is not None:
                    problems.append(row)
    finally:
        _close_all(kept)  # files the directory no longer lists
        _KEPT.give(where, keep)
    models.sort(key=lambda m: m.name)
    # Our segments' strings are printable already (layout.decode_text; a file name that is not fails the name check);
    # a foreign reader's rows are its own to make printable.
    return Scan(tuple(models), tuple(_printable_problem(p) for p in problems))


def _printable_problem(p: Problem) -> Problem:
    path, reason = L.printable(p.path), L.printable(p.reason)
    return p if (path, reason) == (p.path, p.reason) else replace(p, path=path, reason=reason)


def list_models(*, with_pages: bool = False, directory: Path | None = None,
                foreign: Foreign | None = None) -> list[ModelSnapshot]:
    """Snapshots of every model; files that are not usable segments are skipped (see :func:`scan`)."""
    return list(scan(with_pages=with_pages, directory=directory, foreign=foreign).models)


def resolve(name: str, models: list[ModelSnapshot]) -> ModelSnapshot:
    """Find a model by exact name or unique prefix; raise ModelNotFound listing the candidates."""
    exact = [m for m in models if m.name == name]
    if exact:
        return exact[0]
    matches = [m for m in models if m.name.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    names = sorted(m.name for m in (matches or models))
    if matches:
        raise ModelNotFound(f"model name {name!r} is ambiguous: {', '.join(names)}", names)
    known = ", ".join(names) if names else "none running"
    raise ModelNotFound(f"no model named {name!r} (known: {known})", names)


def snapshot(name: str, *, with_pages: bool = True, directory: Path | None = None,
             foreign: Foreign | None = None) -> ModelSnapshot:
    """One model by name or unique prefix, with its page map."""
    for _ in range(BUSY_RETRIES):  # an exact name is one file: no need to read every segment to find it
        try:
            return read_segment(segment_path(name, directory), with_pages=with_pages)
        except BlockingIOError:
            continue  # its writer published throughout one read's copies: read again, it is there
        except (InvalidName, SegmentCorrupt, OSError, ValueError):
            break  # a prefix or a damaged file: the full scan below decides and explains
    for _ in range(SWAP_RETRIES):
        model = resolve(name, list_models(directory=directory, foreign=foreign))
        if model.legacy or not with_pages:
            return model
        try:
            return read_segment(Path(model.path), with_pages=True)
        except FileNotFoundError:
            continue  # removed (or renamed) since the scan saw it: look again
    raise ModelNotFound(f"model {name!r} kept going away while it was read (its file is being replaced)", [])
