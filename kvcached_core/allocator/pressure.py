"""Memory pressure between the models of one device: a model's policy, and reclaim.

Think of the Linux memory controller for cgroups: a limit is memory.max; a model's ``min`` is
memory.min (never reclaimed from it) and its ``priority`` orders who gives first (lower gives first).

A model whose growth the device's budget refused (``KVCACHED_DEVICE_BUDGET`` or
``KVCACHED_HOST_CAPACITY``) asks the other models of that budget for the bytes it lacks, from its
background refill thread, never from ``alloc``: it writes one reclaim request into a donor's
second control block (``layout.RECLAIM_CTL``) and pokes it. Donors are taken lowest priority
first, then the one furthest above its share of the budget, then the longest idle. A donor's
poller answers: reserved pages first, then whole pages of cached blocks through its engine's evict
handler (the one a lowered limit uses, so the engine's prefix index stays right), never an active
block, never below its ``min``; it answers with the bytes it gave (``layout.PRESSURE``) and then
keeps its warm pool down for ``HOLD_S`` (no ping-pong between two busy models): it neither refills it nor
asks another model for a warm pool's worth meanwhile, only for what its own refused growth lacks. One request per
donor at a time: an asker writes only when the donor has answered every earlier one.

An asker whose ask was answered in full may ask again at once, and asks for more each time while
answers keep coming back whole (twice the last ask: 1, 2, 4, 8 pages...), within its headroom under
its limit and what the donors can give; the part beyond what the refused growth itself lacks is
asked only of donors whose priority is not above its own. Only an ask answered short (or by nobody)
holds the next one back for ``REASK_S``. The refill thread maps what was given at once, so no third
model takes it from the budget first.

Everything is counted where kvctl, kvtop and the exporter show it: reclaims asked and answered,
bytes given and taken, the last reclaim's latency and the bytes a model waits for.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..segment import layout as L
from ..segment.control_io import ControlWriteError, write_reclaim, write_without_waiting
from ..segment.reader import read_segment, scan
from ..segment.snapshot import ModelSnapshot
from .poller import poke

if TYPE_CHECKING:
    from .parts import Allocator

log = logging.getLogger(__name__)

HOLD_S = 2.0  # a donor keeps its warm pool down this long after it gave: it asks only for what its growth lacks
REASK_S = 0.25  # after an ask answered short (or by nobody), the next waits this long; a whole answer waits nothing
GROW_KEEP_S = 1.0  # an ask grows from the last whole answer only if that came within this long
ANSWER_WAIT_S = 1.0  # how long an asker waits for one donor's answer before it tries the next
LATE_KEEP_S = 30.0  # an answer that came after ANSWER_WAIT_S is still counted when it comes within this
LATE_LOOK_S = 0.01  # how often the refill thread looks for such an answer
GIVE_WAIT_S = 0.5  # how long a donor waits for its engine to evict cached pages before it answers with what it has
POLL_S = 0.002


@dataclass(frozen=True)
class Candidate:
    """A model that may give: what a reclaim could take from it now, and what orders it."""

    snapshot: ModelSnapshot
    givable: int  # bytes: reserved pages, and whole cached pages when its engine can evict them; down to its min
    priority: int
    above_share: int  # bytes mapped above an equal share of the budget
    idle_s: float


def givable_bytes(snap: ModelSnapshot) -> int:
    """What a reclaim could take from ``snap``: its reserved pages, then its whole cached pages (when its engine
    evicts on request), never below its ``min`` nor an active block."""
    pressure = snap.pressure
    if pressure is None or snap.status != "live" or snap.late:
        return 0
    bundle = snap.bundle_bytes
    free_pages = snap.pages_reserved
    if pressure.can_give_cached and snap.pages is not None and snap.blocks_cached:
        free_pages += sum(1 for e in snap.pages if L.decode_page(e)[0] and L.decode_page(e)[1]
                          and L.decode_page(e)[1] == L.decode_page(e)[2])
    floor = math.ceil(pressure.min_bytes / bundle) * bundle if pressure.min_bytes else 0
    return max(0, min(free_pages * bundle, snap.mapped_bytes - floor))


def donors(models: Sequence[ModelSnapshot], me: ModelSnapshot, budget: int) -> list[Candidate]:
    """The models ``me`` may ask, in the order it asks them: lowest priority first, then the furthest above
    an equal share of ``budget``, then the longest idle. Only models of its backend and device, live, that
    could give something."""
    peers = [s for s in models if s.backend == me.backend and (me.backend == "host" or s.device == me.device)
             and not s.legacy]
    share = budget // max(1, len(peers))
    found: list[Candidate] = []
    for snap in peers:
        if snap.path == me.path or snap.pressure is None:
            continue
        givable = givable_bytes(snap)
        if givable <= 0:
            continue
        idle = snap.traffic.idle_s if snap.traffic is not None else None
        found.append(Candidate(snap, givable, snap.pressure.priority, snap.mapped_bytes - share,
                               idle if idle is not None else float("inf")))
    found.sort(key=lambda c: (c.priority, -c.above_share, -c.idle_s))
    return found


class PressureControl:
    """One allocator's policy (min, priority) and both sides of reclaim: the donor's answers, the asker's requests.

    The donor side runs on the process's poller (:meth:`tick`, lock held); the asker side on the refill
    thread (:meth:`relieve`, lock not held). Figures go to the segment's PRESSURE block.
    """

    def __init__(self, manager: Allocator, min_bytes: int = 0, priority: int = 0) -> None:
        self._m = manager
        self.min_bytes = min_bytes
        self.priority = priority
        self.policy_revision = 0
        self.id = L.model_id(manager.segment.pid, manager.name)
        # donor
        self.acked_seq = 0
        self.given = self.given_reserved = self.given_cached = self.given_took_ns = self.given_to = 0
        self.gave_total = self.gave_count = 0
        self.hold_until = 0.0
        self.give_target: int | None = None  # pages the engine's evict handler works down to (a reclaim waits)
        # a reclaim under way: seq, want, asker, reserved bytes given, pages mapped once those went, started
        self._giving: tuple[int, int, int, int, int, float] | None = None
        # asker
        self.took_total = self.took_count = self.asked_count = 0
        self.wanted = 0  # bytes a refused growth waits for (0: none), its warm pool and a grown ask included
        self.needed = 0  # of those, the bytes the refused growth itself lacks
        self.latency_ns = 0  # the last reclaim: from its ask (or the refused growth, if later) to the bytes given
        self._wanted_since = 0
        self._next_ask = 0.0
        self._grown = 0  # bytes of the last ask answered in full (0: the last was short); the next asks twice that
        self._grown_at = float("-inf")
        # The pacing before asks grew (every ask held the next back REASK_S, given bytes mapped as the warm pool's
        # refill): kept for benchmarks/reclaim.py, which runs both side by side. Nothing else sets it.
        self.fixed_pace = False
        self._asking = threading.Lock()
        # requests whose answer did not come in ANSWER_WAIT_S: (donor's path, seq, wanted since, given up at)
        self._late: list[tuple[Path, int, int, float]] = []
        self._next_late_look = 0.0
        self._write()

    # -- published figures ---------------------------------------------------------------------
    def _write(self) -> None:
        self._m.segment.publish_pressure(
            self.policy_revision, -1 if not self.min_bytes else self.min_bytes, self.priority,
            int(self._m._evict_handler is not None), self.acked_seq, self.given, self.given_reserved,
            self.given_cached, self.given_took_ns, self.given_to, self.gave_total, self.gave_count,
            self.took_total, self.took_count, self.asked_count, self.wanted, self.latency_ns)

    def publish(self) -> None:
        with self._m._lock:
            self._write()

    def pending(self) -> bool:
        """A policy request or a reclaim waits for :meth:`tick` (plain reads, no lock: the poller looks every tick)."""
        policy_revision, reclaim_seq = self._m.segment.request_numbers()
        return self._giving is not None or policy_revision > self.policy_revision or reclaim_seq > self.acked_seq

    def satisfied(self) -> None:
        """A growth succeeded (lock held): nothing waits for memory any more."""
        self.needed = 0
        if self.wanted:
            self.wanted = 0
            self._write()

    @property
    def min_pages(self) -> int:
        return math.ceil(self.min_bytes / self._m.bundle_bytes) if self.min_bytes else 0

    def holding(self) -> bool:
        """The model gave memory lately: its warm pool stays down (no ping-pong)."""
        return time.monotonic() < self.hold_until

    def set_policy(self, min_bytes: int | None, priority: int | None) -> None:
        """Change ``min`` (bytes, 0 or None: none) and ``priority``; None leaves a figure as it is."""
        if min_bytes is not None:
            self.min_bytes = max(0, min_bytes)
        if priority is not None:
            self.priority = priority
        self._write()

    # -- the poller: policy requests and reclaims asked of this model --------------------------------
    def tick(self) -> None:
        """Take a controller's policy request and serve a reclaim (lock held by the caller)."""
        m = self._m
        policy = m.segment.read_policy_request()
        if policy is not None and policy[0] > self.policy_revision:
            revision, min_bytes, priority = policy
            self.policy_revision = revision
            self.set_policy(None if min_bytes == L.POLICY_MIN_KEEP else max(0, min_bytes),
                            None if priority == L.POLICY_PRIORITY_KEEP else priority)
        if self._giving is not None:
            self._finish_give(force=False)
            return
        reclaim = m.segment.read_reclaim_request()
        if reclaim is not None and reclaim[0] > self.acked_seq:
            self._give(*reclaim)

    def _give(self, seq: int, want: int, asker: int) -> None:
        m = self._m
        started = time.monotonic()
        bundle = m.bundle_bytes
        self.hold_until = started + HOLD_S
        room = max(0, m.pages.mapped_pages - self.min_pages)  # never below min
        pages = min(room, math.ceil(want / bundle))
        reserved = m._unmap_reserved(min(pages, len(m.pages.reserved)))
        m.backend.trim_pool(0)  # a pool of device handles counts against the budget too
        missing = pages - reserved // bundle
        handler = m._evict_handler
        giving = (seq, want, asker, reserved, m.pages.mapped_pages, started)
        if missing > 0 and handler is not None and m.cache.blocks:
            self.give_target = max(self.min_pages, m.pages.pages_inuse - missing)
            self._giving = giving
            try:
                handler()
            except Exception:  # the engine could not evict: it gives what it gave
                log.exception("%s: the engine's evict handler failed during a reclaim", m.name)
            self._finish_give(force=False)
            return
        self._giving = giving
        self._finish_give(force=True)

    def _finish_give(self, *, force: bool) -> None:
        """Answer the reclaim under way once the engine evicted down to the target (or it waited long enough)."""
        assert self._giving is not None
        m = self._m
        seq, want, asker, reserved, mapped_before, started = self._giving
        target = self.give_target
        done = target is None or m.pages.pages_inuse <= target
        if not (done or force or time.monotonic() - started >= GIVE_WAIT_S):
            return
        # The pages the eviction emptied joined the warm pool (they go now, as far as the request asked) or,
        # past the pool's maximum, were unmapped as they emptied: both are cached pages given.
        bundle = m.bundle_bytes
        already = max(0, mapped_before - m.pages.mapped_pages)
        pages = max(0, math.ceil(want / bundle) - reserved // bundle - already)
        pages = min(pages, max(0, m.pages.mapped_pages - self.min_pages))
        m._unmap_reserved(min(pages, len(m.pages.reserved)))
        cached = max(0, mapped_before - m.pages.mapped_pages) * bundle
        m.backend.trim_pool(0)
        flush = getattr(m.backend, "flush", None)
        if flush is not None:
            flush()  # the bytes are free for the asker when the answer says so (deferred unmaps done)
        self._giving = None
        self.give_target = None
        self.given, self.given_reserved, self.given_cached = reserved + cached, reserved, cached
        self.given_took_ns = int((time.monotonic() - started) * 1e9)
        self.given_to = asker
        self.gave_total += self.given
        self.gave_count += 1
        self.acked_seq = seq
        self.hold_until = time.monotonic() + HOLD_S
        m._publish()
        self._write()

    # -- the refill thread: ask the others ------------------------------------------------------------
    def note_refused(self, nbytes: int) -> None:
        """A growth of ``nbytes`` was refused by the budget (lock held): the refill thread asks for them, and for
        a warm pool's worth beside them (so the allocs that follow are served from the pool, not by one reclaim
        each), as far as the model's limit lets it map."""
        m = self._m
        room = m._headroom() * m.bundle_bytes
        # a warm pool's worth beside it, unless the model gave lately: its pool stays down (no ping-pong)
        ask = nbytes + (0 if self.holding() and not self.fixed_pace else m.min_reserved * m.bundle_bytes)
        if not self.fixed_pace and time.monotonic() - self._grown_at < GROW_KEEP_S:
            ask = max(ask, 2 * self._grown)  # the last ask was answered in full: this one asks for twice as much
        self.needed = max(self.needed, min(nbytes, room))
        ask = min(ask, room)
        if not self.wanted:
            self._wanted_since = time.monotonic_ns()
        if ask > self.wanted:
            self.wanted = ask
            self._write()

    def relieve(self) -> int:
        """Ask donors for the bytes a refused growth waits for (refill thread, lock not held); the bytes given."""
        if not self.wanted or (self.fixed_pace and self.holding()) or time.monotonic() < self._next_ask:
            return 0
        if not self._asking.acquire(blocking=False):
            return 0
        whole = False
        try:
            got, whole = self._ask_donors()
            return got
        finally:
            # Only a short answer holds the next ask back: a model growing page by page behind a donor that gives
            # in full waits for no clock (the fixed pace held every ask back, one page every REASK_S).
            self._next_ask = time.monotonic() + (0.0 if whole and not self.fixed_pace else REASK_S)
            self._asking.release()

    def next_ask_in(self) -> float | None:
        """Seconds until a refused growth that still waits may ask again (0 when it may now); None when none waits.
        A refill thread that sleeps until woken wakes by then: no alloc may come to wake it (a plain read)."""
        if not self.wanted or (self.fixed_pace and self.holding()):
            return None
        return max(0.0, self._next_ask - time.monotonic())

    @property
    def late(self) -> bool:
        """A donor's answer is overdue: :meth:`collect_late` counts it when it comes (a plain read, no lock)."""
        return bool(self._late)

    def collect_late(self) -> None:
        """Count the answers that came after the asker stopped waiting (refill thread, lock not held).

        A donor that answers late gave its bytes all the same; the budget has them and this model's growth
        maps them. Without this, what a model took would read less than what its donors gave."""
        if time.monotonic() < self._next_late_look:
            return
        self._next_late_look = time.monotonic() + LATE_LOOK_S
        still: list[tuple[Path, int, int, float]] = []
        got = answered = 0
        latency = 0
        for path, seq, since, given_up in self._late:
            try:
                snap = read_segment(path)
            except BlockingIOError:
                snap = None
            except (OSError, ValueError):
                continue  # gone: its answer will not come
            if snap is not None and snap.pressure is not None and snap.pressure.reclaim_acked_seq >= seq:
                if snap.pressure.reclaim_acked_seq == seq and snap.pressure.given_bytes:
                    got += snap.pressure.given_bytes
                    answered += 1
                    latency = time.monotonic_ns() - since
                continue  # answered (a later request's answer hides this one's bytes: not counted)
            if (snap is None or snap.status == "live") and time.monotonic() - given_up < LATE_KEEP_S:
                still.append((path, seq, since, given_up))
        with self._m._lock:
            self._late = still
            if got:
                self.took_total += got
                self.took_count += answered
                self.latency_ns = latency
                self._write()
        if got:
            self._m._room_came()  # the budget has the late answer's bytes: an engine that waits for room looks now

    def _ask_donors(self) -> tuple[int, bool]:
        """Ask the donors in their order for what is wanted: the bytes given, and whether that was all of it."""
        m = self._m
        asked_at = time.monotonic_ns()
        found = scan(with_pages=True, directory=m.segment.path.parent)
        me = next((s for s in found.models if s.path == str(m.segment.path)), None)
        if me is None:
            return 0, False
        got = 0
        want, need = self.wanted, min(self.needed, self.wanted)
        for candidate in donors(found.models, me, m.backend.capacity_bytes()):
            # beyond what the refused growth lacks (its warm pool, a grown ask) only models of no higher priority
            ask = min((want if candidate.priority <= self.priority else need) - got, candidate.givable)
            if ask <= 0:
                continue
            given = self._ask(candidate.snapshot, ask)
            if given is None:
                continue
            got += given
            if got >= want:
                break
        whole = want > 0 and got >= want
        with m._lock:
            now = time.monotonic_ns()
            if got:
                self.took_total += got
                self.took_count += 1
                self.latency_ns = now - max(self._wanted_since, asked_at)  # the ask to its answer, no pacing wait
            self.wanted = 0 if whole else max(0, self.wanted - got)
            self.needed = 0 if whole else max(0, self.needed - got)
            if self.wanted and got:
                self._wanted_since = now
            self._grown, self._grown_at = (want, time.monotonic()) if whole else (0, float("-inf"))
            self._write()
        return got, whole

    def _ask(self, donor: ModelSnapshot, want: int) -> int | None:
        """One reclaim request to ``donor`` and its answer: the bytes it gave; None when it could not be asked
        (a request of another model outstanding, its lock held, gone) or did not answer in time."""
        path = Path(donor.path)
        pressure = donor.pressure
        assert pressure is not None

        try:  # 0: one request per donor, and another model's is outstanding
            written = write_without_waiting(path, lambda mm: write_reclaim(mm, want, self.id, pressure.reclaim_acked_seq))
        except (ControlWriteError, OSError, ValueError):
            return None
        if written is None or not written[0]:
            return None
        seq, token = written
        with self._m._lock:
            self.asked_count += 1
            self._write()
        poke(token)
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline:
            try:
                snap = read_segment(path)
            except BlockingIOError:
                snap = None
            except (OSError, ValueError):
                return None  # gone: the asker goes on with the next
            if snap is not None and snap.pressure is not None and snap.pressure.reclaim_acked_seq >= seq:
                return snap.pressure.given_bytes if snap.pressure.reclaim_acked_seq == seq else 0
            if snap is not None and snap.status != "live":
                return None
            time.sleep(POLL_S)
        with self._m._lock:  # it may still answer: counted when it does
            self._late.append((path, seq, self._wanted_since, time.monotonic()))
        return None
