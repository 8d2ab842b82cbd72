"""Seqlock stress harness: writers hammer segments, readers snapshot them; no torn copy may be accepted.

Each writer owns one segment and publishes update after update through :class:`SegmentWriter`
(the allocator's own publish path, without the allocator's bookkeeping, so a million updates
take seconds). Every update rewrites a few page-map entries and all counters, and the values
are tied together so that a copy mixing two updates breaks an invariant (see
:func:`violations`). Reader processes take snapshots with :func:`kvcached_core.segment.reader.read_segment`
(with and without the page map) as fast as they can and check each accepted one; every
``16``th time they also take a plain copy without the seqlock, to show the invariants catch
tearing. ``tests/test_hardening_concurrency.py`` runs it; ``benchmarks/stress.py`` times it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from kvcached_core.segment import layout as L
from kvcached_core.segment.names import SEGMENT_PREFIX
from kvcached_core.segment.reader import SegmentCorrupt, read_segment
from kvcached_core.segment.snapshot import ModelSnapshot
from kvcached_core.segment.writer import Identity, SegmentWriter

PAGES = 64
BLOCKS_PER_PAGE = 16
PAGE_SIZE = 1 << 20
BLOCK_BYTES = PAGE_SIZE // BLOCKS_PER_PAGE
BUNDLE = PAGE_SIZE * 2  # one layer, K and V
PAGES_PER_UPDATE = 3
STATUS_OF = {0: "none", 1: "applied", 2: "deferred"}


def identity(name: str) -> Identity:
    return Identity(name=name, model=name, engine="stress", backend="host", device=0, page_size=PAGE_SIZE,
                    block_bytes=BLOCK_BYTES, num_layers=1, num_kv_buffers=2, blocks_per_page=BLOCKS_PER_PAGE,
                    num_blocks=PAGES * BLOCKS_PER_PAGE, pages_total=PAGES)


class Workload:
    """The writer's side: update ``i`` changes a few pages and derives every counter from ``i`` and the map."""

    def __init__(self, writer: SegmentWriter, writer_id: int) -> None:
        self.w = writer
        self.writer_id = writer_id
        self.used = [0] * PAGES
        self.mapped = [False] * PAGES
        self.inuse = self.reserved = self.blocks = self.cached = 0

    def _set(self, page: int, mapped: bool, used: int) -> None:
        old_used, old_mapped = self.used[page], self.mapped[page]
        self.inuse += (used > 0) - (old_used > 0)
        self.reserved += (mapped and not used) - (old_mapped and not old_used)
        self.blocks += used - old_used
        self.cached += used // 2 - old_used // 2
        self.used[page], self.mapped[page] = used, mapped
        self.w.set_page(page, L.page_entry(mapped, used, used // 2))

    def update(self, i: int) -> None:
        self.w.begin()
        for j in range(PAGES_PER_UPDATE):
            page = (i * 7 + j * 23) % PAGES
            used = (i + j) % (BLOCKS_PER_PAGE + 1)
            self._set(page, used > 0 or (i + j) % 3 == 0, used)
        half = i // 2
        self.w.publish((
            self.inuse, self.reserved, self.blocks, self.cached, (self.inuse + self.reserved) * BUNDLE,
            i, half, 3 * i, 3 * half, self.blocks ^ i, 1000 * i,
            i % 3, 0, i, i, i, 5 * i, -1, i * i, self.writer_id, 1,
        ))


def violations(s: ModelSnapshot, writer_id: int | None = None) -> list[str]:
    """Every invariant an accepted snapshot must satisfy; [] when the copy is consistent."""
    i, bad = s.alloc_count, []
    expect = {
        "free_count": i // 2, "alloc_blocks": 3 * i, "free_blocks": 3 * (i // 2), "updated_ns": 1000 * i,
        "limit_bytes": i if i else None,  # update 0: never published
        "applied_revision": i, "trim_ack_seq": i, "trim_bytes": 5 * i,
        "trimmed_total": i * i, "evicted_blocks": s.blocks_used ^ i,
        "mapped_bytes": (s.pages_inuse + s.pages_reserved) * BUNDLE,
        "limit_status": STATUS_OF[i % 3],
    }
    if writer_id is not None and i:
        expect["idle_returned"] = writer_id
    for field, want in expect.items():
        if getattr(s, field) != want:
            bad.append(f"{field}={getattr(s, field)} but update {i} implies {want}")
    if s.pages is not None:
        used = [e & L.PAGE_FIELD_MASK for e in s.pages]
        mapped = [bool(e & L.PAGE_MAPPED) for e in s.pages]
        from_map = {
            "pages_inuse": sum(1 for u in used if u),
            "pages_reserved": sum(1 for u, m in zip(used, mapped, strict=True) if m and not u),
            "blocks_used": sum(used),
            "blocks_cached": sum((e >> L.PAGE_CACHED_SHIFT) & L.PAGE_FIELD_MASK for e in s.pages),
        }
        for field, want in from_map.items():
            if getattr(s, field) != want:
                bad.append(f"{field}={getattr(s, field)} but the page map says {want}")
    return bad


# -- processes -----------------------------------------------------------------------------

def _writer(directory: str, name: str, writer_id: int, updates: int, timed: bool, start, out) -> None:
    os.environ["KVCACHED_SHM_DIR"] = directory
    writer = SegmentWriter(identity(name))
    work = Workload(writer, writer_id)
    times = array("q", bytes(8 * updates)) if timed else None
    start.wait(timeout=120)
    clock = time.perf_counter_ns
    began = clock()
    if times is None:
        for i in range(1, updates + 1):
            work.update(i)
    else:
        for i in range(1, updates + 1):
            t0 = clock()
            work.update(i)
            times[i - 1] = clock() - t0
    elapsed = clock() - began
    writer.heartbeat()
    result = {"updates": updates, "seconds": elapsed / 1e9}
    if times is not None:
        ordered = sorted(times)
        result.update({f"p{q}": ordered[min(updates - 1, int(updates * q / 100))] / 1000 for q in (50, 99, 99.9)})
    writer.close(unlink=False)
    out.put(("writer", name, result))


def _reader(directory: str, names: list[str], writer_ids: dict[str, int], stop, start, out) -> None:
    paths = [Path(directory) / (SEGMENT_PREFIX + n) for n in names]
    accepted = busy = raw_copies = raw_torn = 0
    bad: list[str] = []
    start.wait(timeout=120)
    n = 0
    while not stop.is_set():
        path = paths[n % len(paths)]
        name = names[n % len(names)]
        n += 1
        try:
            snap = read_segment(path, with_pages=n % 2 == 0)
        except BlockingIOError:
            busy += 1
            continue
        except (FileNotFoundError, SegmentCorrupt) as exc:
            bad.append(f"{name}: {exc}")
            continue
        accepted += 1
        problems = violations(snap, writer_ids[name])
        if problems:
            bad.append(f"{name} accepted a torn copy: {problems[0]}")
        if n % 16 == 0:  # a copy without the seqlock, to show the invariants catch tearing
            raw_copies += 1
            raw_torn += bool(_raw_violations(path))
    out.put(("reader", os.getpid(), {"accepted": accepted, "busy": busy, "violations": bad[:20],
                                     "violation_count": len(bad), "raw_copies": raw_copies, "raw_torn": raw_torn}))


def _raw_violations(path: Path) -> list[str]:
    """Decode one plain copy of counters + page map, trusting nothing: what a lock-free reader without a seqlock sees."""
    with open(path, "rb") as fh:
        raw = fh.read(L.PAGE_MAP_OFF + 4 * PAGES)
    counters = dict(zip(L.COUNTER_FIELDS, L.COUNTERS.unpack_from(raw, L.COUNTERS_OFF), strict=True))
    pages = array("I")
    pages.frombytes(raw[L.PAGE_MAP_OFF:L.PAGE_MAP_OFF + 4 * PAGES])
    fields = {f: counters[f] for f in ("pages_inuse", "pages_reserved", "blocks_used", "blocks_cached",
                                       "mapped_bytes", "alloc_count", "free_count", "alloc_blocks", "free_blocks",
                                       "evicted_blocks", "updated_ns", "applied_revision", "trim_ack_seq",
                                       "trim_bytes", "trimmed_total", "idle_returned")}
    snap = ModelSnapshot(name="raw", path=str(path), model="raw", engine="", backend="", pid=0, uid=0, device=0,
                         status="live", page_size=PAGE_SIZE, block_bytes=BLOCK_BYTES, num_layers=1, num_kv_buffers=2,
                         blocks_per_page=BLOCKS_PER_PAGE, num_blocks=PAGES * BLOCKS_PER_PAGE, pages_total=PAGES,
                         limit_bytes=counters["effective_limit"] if counters["effective_limit"] >= 0 else None,
                         limit_status=STATUS_OF.get(counters["limit_status"], "unknown"), pages=pages, **fields)
    return violations(snap)


@dataclass(frozen=True)
class StressResult:
    writers: list[dict]
    readers: list[dict]

    @property
    def updates(self) -> int:
        return sum(w["updates"] for w in self.writers)

    @property
    def accepted(self) -> int:
        return sum(r["accepted"] for r in self.readers)

    @property
    def violations(self) -> list[str]:
        return [v for r in self.readers for v in r["violations"]]

    @property
    def violation_count(self) -> int:
        return sum(r["violation_count"] for r in self.readers)


def stress(writers: int, readers: int, updates_per_writer: int, *, timed: bool = False,
           directory: str | None = None, timeout: float = 300) -> StressResult:
    """Run ``writers`` writer and ``readers`` reader processes until every writer has published its updates."""
    ctx = mp.get_context("spawn")  # no fork of a caller that may run threads (pytest, an app)
    with tempfile.TemporaryDirectory(prefix="kvc-stress-", dir=directory or _default_dir()) as tmp:
        names = [f"stress{w}" for w in range(writers)]
        ids = {name: w + 1 for w, name in enumerate(names)}
        # Everyone (writers, readers, this process) starts together, once every process has imported.
        start, stop, out = ctx.Barrier(writers + readers + 1), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(tmp, n, ids[n], updates_per_writer, timed, start, out))
                 for n in names]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 30
        while not all((Path(tmp) / f"kvc.{n}").exists() for n in names):  # segments exist before readers look
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a stress writer did not start")
            time.sleep(0.01)
        reader_procs = [ctx.Process(target=_reader, args=(tmp, names, ids, stop, start, out)) for _ in range(readers)]
        for p in reader_procs:
            p.start()
        start.wait(timeout=120)
        results: dict[str, list[dict]] = {"writer": [], "reader": []}
        try:
            for _ in range(writers):
                kind, _, result = out.get(timeout=timeout)
                results[kind].append(result)
            stop.set()
            for _ in range(readers):
                kind, _, result = out.get(timeout=60)
                results[kind].append(result)
        finally:
            stop.set()
            for p in procs + reader_procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if len(results["writer"]) != writers or len(results["reader"]) != readers:
            raise RuntimeError("a stress process exited without reporting")
        return StressResult(results["writer"], results["reader"])


def _default_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
