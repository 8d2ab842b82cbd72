"""The segment reader as it was at commit 9b05ad6, before it kept files open between scans: kept
so that ``benchmarks/snapshots.py`` measures the reader against it in the same run, on the same
load (the issue's "against today's code in the same run").

``scan`` and ``read_segment`` here open, fstat, read and close every file on every scan, parse
every header, and ask /proc about the writer once per model; the helpers they share with the
current reader (header parsing, the counters' decoding, the problems' wording) are imported.
Not used by the package.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from array import array
from pathlib import Path

from kvcached_core.interop.legacy import NotLegacy, _printable, is_legacy_name, read_legacy
from kvcached_core.segment import layout as L
from kvcached_core.segment.liveness import judge, writer_alive
from kvcached_core.segment.names import SEGMENT_PREFIX
from kvcached_core.segment.pgroups import GroupJudge
from kvcached_core.segment.procinfo import is_alive
from kvcached_core.segment.reader import (
    DEAD_WRITER_CHECK,
    QUIET_FAILURES,
    READ_RETRIES,
    HeaderOverwritten,
    PublishUnfinished,
    SegmentCorrupt,
    _backoff,
    _printable_problem,
    _rank_bytes,
    _unpublished_counters,
    parse_header,
)
from kvcached_core.segment.sealed import read_words as _words
from kvcached_core.segment.snapshot import ModelSnapshot, Problem, RankInfo, Scan, Traffic
from kvcached_core.settings import settings


def _legacy_sized(path: str) -> bool:
    """A regular file of exactly upstream's struct size (the reader's test at 9b05ad6)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == L.LEGACY_SIZE


_SUMS: dict[str, tuple[bytes, int]] = {}  # per segment name: the last page map summed, and its sum
_SUMS_MAX = 4096


def page_sum(name: str, map_raw: bytes, pages: array) -> int:
    """The page map's sum mod 2**64, as the writer keeps it in ``page_sum``.

    A map byte-identical to the last one summed for ``name`` costs one compare instead of a sum
    over every page: between publishes (most reads of a dashboard) nothing is recomputed.
    """
    last = _SUMS.get(name)
    if last is not None and last[0] == map_raw:
        return last[1]
    total = sum(pages) & 0xFFFFFFFFFFFFFFFF
    if len(_SUMS) >= _SUMS_MAX:
        _SUMS.clear()
    _SUMS[name] = (map_raw, total)
    return total


def _consistent_copy(fd: int, header: dict, with_pages: bool) -> tuple[dict, array | None, bytes]:
    """Copy counters (and the page map) until one copy passes the seqlock and both checksums."""
    pages_total = header["pages_total"]
    size = L.total_size(pages_total, header["ranks_max"])
    end = size if with_pages else L.PAGE_MAP_OFF
    if os.fstat(fd).st_size < size:
        raise SegmentCorrupt("file shorter than its header says")
    seqs_seen: set[int] = set()
    quiet_failures = 0
    for attempt in range(READ_RETRIES):
        raw = os.pread(fd, end, 0)
        if len(raw) < end:
            raise SegmentCorrupt("file shrank while reading")
        seq = L.U64.unpack_from(raw, L.SEQ_OFF)[0]
        seqs_seen.add(seq)
        if seq & 1:
            if attempt == DEAD_WRITER_CHECK and seqs_seen == {seq} and not writer_alive(header, raw):
                raise PublishUnfinished(f"a publish never finished (sequence {seq} stayed odd)")
            _backoff(attempt)
            continue
        if os.pread(fd, 8, L.SEQ_OFF) != raw[L.SEQ_OFF:L.SEQ_OFF + 8]:
            _backoff(attempt)  # the writer moved on during the copy: check again right away, no work wasted
            continue
        # The sequence was even and unchanged around the copy: verify it (on weakly ordered CPUs too).
        payload = raw[L.COUNTERS_OFF:L.CHECKSUM_OFF]
        check = L.U64.unpack_from(raw, L.CHECKSUM_OFF)[0]
        pages = None
        if seq == 0:  # never published yet: all zeros
            counters = _unpublished_counters()
        elif check != L.counters_checksum(payload, seq):
            counters = None
        else:
            counters = dict(zip(L.COUNTER_FIELDS, L.COUNTERS.unpack(payload), strict=False))
        if counters is not None and with_pages:
            map_raw = raw[L.PAGE_MAP_OFF:L.PAGE_MAP_OFF + 4 * pages_total]
            pages = array("I")
            pages.frombytes(map_raw)
            if page_sum(header["name"], map_raw, pages) != counters["page_sum"]:
                counters = None
        if counters is None:
            quiet_failures += 1  # the writer did not move: the file really holds this
            if quiet_failures >= QUIET_FAILURES:
                raise SegmentCorrupt("checksum mismatch in a quiet segment")
            _backoff(attempt)
            continue
        return counters, pages, raw
    if len(seqs_seen) == 1:  # nobody is writing, yet no copy checks out
        seq = seqs_seen.pop()
        if seq & 1:
            raise PublishUnfinished(f"a publish never finished (sequence {seq} stayed odd)")
        raise SegmentCorrupt("checksum mismatch in a quiet segment")
    raise BlockingIOError("no consistent copy after retries: the writer is very busy")


def read_segment(path: Path, *, with_pages: bool = False, now_ns: int | None = None) -> ModelSnapshot:
    """Read one of our segments; raises SegmentCorrupt, BlockingIOError or OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentCorrupt("not a regular file: a symbolic link (never followed)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SegmentCorrupt("not a regular file")
        header = parse_header(os.pread(fd, L.HEADER.size, 0))
        if path.name != SEGMENT_PREFIX + header["name"]:
            raise SegmentCorrupt(f"the header names segment {header['name']!r}, not this file")
        try:
            counters, pages, body = _consistent_copy(fd, header, with_pages)
        except PublishUnfinished as exc:
            if writer_alive(header, os.pread(fd, L.PAGE_MAP_OFF, 0)):
                raise BlockingIOError(f"{exc}: its writer (pid {header['pid']}) is alive but stuck") from None
            # The writer died mid-publish: whatever it counted is no longer held. Show it stale and empty.
            counters = _unpublished_counters()
            body = os.pread(fd, L.total_size(header["pages_total"], header["ranks_max"]) if with_pages
                            else L.PAGE_MAP_OFF, 0)
            pages = array("I", bytes(4 * header["pages_total"])) if with_pages else None
        rank_raw = _rank_bytes(fd, header, body) if header["tp_world"] > 1 else b""
    finally:
        os.close(fd)
    control = dict(zip(("limit", "revision", "check", "trim_seq"), L.CONTROL.unpack_from(body, L.CONTROL_OFF), strict=False))
    heartbeat = L.U64.unpack_from(body, L.HEARTBEAT_OFF)[0]
    now_ns = now_ns or time.time_ns()
    verdict = judge(header["pid"], header["start_time"], header["pid_ns"], heartbeat, now_ns)
    status = "live" if verdict.alive and not counters["closing"] else "stale"
    ranks: tuple[RankInfo, ...] = ()
    if rank_raw:
        found = []
        for i in range(min(counters["ranks_active"], header["ranks_max"], len(rank_raw) // L.RANK.size)):
            r = dict(zip(L.RANK_FIELDS, L.RANK.unpack_from(rank_raw, i * L.RANK.size), strict=False))
            lost = bool(r["flags"] & L.RANK_LOST)
            found.append(RankInfo(r["rank"], r["device"], r["pid"], r["mapped_bytes"],
                                  not lost and is_alive(r["pid"], r["start_time"])))
        ranks = tuple(found)
    effective = counters["effective_limit"]
    # A controller's request not yet applied shows as asked; otherwise what the allocator applied
    # last, which also covers limits the engine set itself with set_limit().
    pending = control["revision"] > counters["applied_revision"]
    requested = control["limit"] if pending else counters["requested_limit"]
    limit_status = L.LIMIT_STATUS_NAMES.get(counters["limit_status"], "unknown")
    if status == "stale" and control["revision"] > counters["applied_revision"]:
        limit_status = "stale"
    words = _words(body, header, counters, None)  # the sealed blocks (layout 3), decoded as the current reader does
    return ModelSnapshot(
        name=header["name"], path=str(path), model=header["model"], engine=header["engine"],
        backend=header["backend"], pid=header["pid"], uid=header["uid"],
        device=header["device"], status=status, page_size=header["page_size"],
        block_bytes=header["block_bytes"], num_layers=header["num_layers"],
        num_kv_buffers=header["num_kv_buffers"], blocks_per_page=header["blocks_per_page"],
        num_blocks=header["num_blocks"], pages_total=header["pages_total"],
        pages_inuse=counters["pages_inuse"], pages_reserved=counters["pages_reserved"],
        blocks_used=counters["blocks_used"], blocks_cached=counters["blocks_cached"],
        mapped_bytes=counters["mapped_bytes"],
        limit_bytes=None if effective < 0 else effective, limit_status=limit_status,
        requested_limit=None if requested < 0 else requested, limit_revision=control["revision"],
        applied_revision=counters["applied_revision"], trim_seq=control["trim_seq"],
        trim_ack_seq=counters["trim_ack_seq"], trim_bytes=counters["trim_bytes"],
        trimmed_total=counters["trimmed_total"], idle_returned=counters["idle_returned"],
        alloc_count=counters["alloc_count"], free_count=counters["free_count"],
        alloc_blocks=counters["alloc_blocks"], free_blocks=counters["free_blocks"],
        evicted_blocks=counters["evicted_blocks"], updated_ns=counters["updated_ns"],
        heartbeat_ns=heartbeat, read_ns=now_ns, start_time=header["start_time"],
        late=status == "live" and verdict.late, pid_ns=header["pid_ns"],
        tp_world=header["tp_world"], ranks=ranks, pages=pages,
        device_capacity=header["device_capacity"],
        traffic=None if words.traffic is None else Traffic(*words.traffic, now_ns), sleep=words.sleep,
        compaction=words.compaction,
    )


def scan(*, with_pages: bool = False, directory: Path | None = None) -> Scan:
    """Every segment in the directory, plus a Problem for each file we could not use."""
    base = directory or settings().shm_dir
    models: list[ModelSnapshot] = []
    problems: list[Problem] = []
    try:
        entries = sorted(os.listdir(base))
    except OSError as exc:
        return Scan((), (Problem(str(base), "unreadable", exc.strerror or str(exc)),))
    now_ns = time.time_ns()
    judge = GroupJudge()
    for filename in entries:
        path = base / filename
        if filename.startswith(SEGMENT_PREFIX):
            try:
                models.append(read_segment(path, with_pages=with_pages, now_ns=now_ns))
            except HeaderOverwritten as exc:
                problems.append(Problem(str(path), "corrupt", str(exc), exc.writer_alive))
            except SegmentCorrupt as exc:
                kind = "foreign" if "magic" in str(exc) or "regular file" in str(exc) else "corrupt"
                problems.append(Problem(str(path), kind, str(exc)))
            except BlockingIOError as exc:
                problems.append(Problem(str(path), "busy", str(exc)))
            except FileNotFoundError:
                continue  # removed while we listed
            except (OSError, ValueError, OverflowError, MemoryError) as exc:
                problems.append(Problem(str(path), "unreadable", str(exc)))
        elif not filename.startswith(".") and ((named := is_legacy_name(filename)) or _legacy_sized(path)):
            try:
                models.append(read_legacy(path, named=named, judge=judge))
            except FileNotFoundError:
                continue
            except BlockingIOError as exc:
                problems.append(Problem(str(path), "busy", str(exc)))
            except NotLegacy as exc:
                problems.append(Problem(str(path), "foreign", str(exc)))
            except (OSError, ValueError) as exc:
                problems.append(Problem(str(path), "unreadable" if isinstance(exc, OSError) else "foreign", str(exc)))
    models.sort(key=lambda m: m.name)
    return Scan(tuple(_printable(m) for m in models), tuple(_printable_problem(p) for p in problems))


def list_models(*, with_pages: bool = False, directory: Path | None = None) -> list[ModelSnapshot]:
    return list(scan(with_pages=with_pages, directory=directory).models)
