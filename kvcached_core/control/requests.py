"""The controller's side: ask a model for a new limit or a trim and wait for its acknowledgement.

Controllers write only the CONTROL block, serialised among themselves by flock on the segment;
the allocator never takes that lock, so a controller can never stall an engine.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..allocator.poller import poke
from ..fleet import ModelNotFound, resolve, scan
from ..interop.legacy import flock_within, limit_refusal, percent_base, write_legacy_limit
from ..segment import layout as L
from ..segment.control_io import ControlWriteError, next_sequence, open_for_control, wake_token, write_limit
from ..segment.names import SEGMENT_PREFIX
from ..segment.reader import read_segment
from ..segment.snapshot import ModelSnapshot
from ..settings import ConfigError, settings

POLL_S = 0.002
FIRST_POLL_S = 0.0001  # the first looks for the acknowledgement come sooner, doubling up to POLL_S
POLL_DOUBLINGS = 5  # FIRST_POLL_S * 2**5 > POLL_S: the backoff stops growing there, however long the wait
DEFAULT_WAIT_S = 2.0
LOCK_TIMEOUT_S = 2.0  # controllers hold the lock for microseconds


class ControlError(RuntimeError):
    """A request could not be made (not our segment, not live, bad value)."""


class AckTimeout(TimeoutError):
    """The model did not acknowledge in time; ``ack`` holds what it had acknowledged so far."""

    def __init__(self, message: str, ack: Ack):
        super().__init__(message)
        self.ack = ack


@dataclass(frozen=True)
class Ack:
    """A model's answer to a control request."""

    name: str
    kind: str  # limit, trim, compact (sleep and wake: the action)
    status: str  # applied, deferred, conflict, none, trimmed, pending, legacy, superseded; sleep: its state, woken
    revision: int
    effective_limit: int | None = None
    bytes_returned: int = 0
    latency_s: float = 0.0
    in_use: int | None = None  # upstream segments: bytes in use when the limit was written (it applies once within)
    superseded_by: int = 0  # status superseded: the later revision (another controller's) that the model applied
    superseding_status: str = ""  # and that revision's status; effective_limit is then its limit
    bytes_copied: int = 0  # compact: KV bytes the engine copied
    after_idle_s: float | None = None  # sleep: the after-idle policy the model holds once it took the request
    answered_range: tuple[int, int] | None = None  # compact: the requests (first, last) its one compaction answered


def _open_for_control(path: Path) -> tuple[int, mmap.mmap]:
    try:
        return open_for_control(path)
    except ControlWriteError as exc:
        raise ControlError(str(exc)) from None


def _wake(mm: mmap.mmap) -> None:
    """Poke the allocator so it applies the request now instead of at its next heartbeat tick."""
    poke(wake_token(mm))


def _lock(fd: int, path: Path) -> None:
    try:
        flock_within(fd, fcntl.LOCK_EX, LOCK_TIMEOUT_S)
    except BlockingIOError as exc:
        raise ControlError(f"{path.name}: another controller holds its lock ({exc})") from None



def write_request(path: Path, write: Callable[[mmap.mmap], int]) -> int:
    """Run ``write(mm)`` on the segment under the controllers' lock, then wake the allocator.

    ``write`` writes one request record (its revision word last) and returns that revision.
    """
    fd, mm = _open_for_control(path)
    try:
        _lock(fd, path)
        try:
            revision = write(mm)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        _wake(mm)
    finally:
        mm.close()
        os.close(fd)
    return revision


def bump_sequence(path: Path, offset: int) -> int:
    """A sequence-numbered request (trim, compact): add one to the u64 at ``offset`` under the controllers'
    lock, wake the allocator, and return the new sequence number."""
    return write_request(path, lambda mm: next_sequence(mm, offset))


BUSY_RETRIES = 5  # scans (each retries its copy for ~0.4 s), while the named model's writer is too busy to read


def _target(name_or_snapshot: str | ModelSnapshot) -> ModelSnapshot:
    """The model to ask: a busy writer (no consistent copy in one read) is looked at again, not
    reported as missing; still busy after about 2 s, it is a :class:`ControlError` that says so."""
    if isinstance(name_or_snapshot, ModelSnapshot):
        return name_or_snapshot
    attempt = 0
    while True:
        found = scan()
        try:
            return resolve(name_or_snapshot, list(found.models))
        except ModelNotFound:
            busy = [p for p in found.problems if p.status == "busy" and Path(p.path).name == SEGMENT_PREFIX + name_or_snapshot]
            attempt += 1
            if not busy:
                raise
            if attempt == BUSY_RETRIES:
                raise ControlError(f"{name_or_snapshot} is too busy to read right now ({busy[0].reason}); "
                                   "try again") from None
        time.sleep(0.05)


def _pause(looks: int, left: float) -> float:
    """How long to sleep before look ``looks + 1``: FIRST_POLL_S doubling up to POLL_S (a poked allocator
    answers fast: benchmarks/acks.py), never past the deadline ``left`` seconds away."""
    return max(0.0, min(POLL_S, FIRST_POLL_S * 2 ** min(looks, POLL_DOUBLINGS), left))


def _wait(model: ModelSnapshot, done: Callable[[ModelSnapshot], Ack | None], wait: float, kind: str,
          pending: Ack, started: float) -> Ack:
    """Read ``model`` until ``done(snapshot)`` answers; :class:`AckTimeout` once ``wait`` seconds from ``started``
    have passed without an answer."""
    deadline = started + wait
    path = Path(model.path)
    looks = 0
    while True:
        try:
            snap = read_segment(path)
        except BlockingIOError:  # a publish under way for long: not an answer yet
            snap = None
        except (OSError, ValueError) as exc:
            raise ControlError(f"{model.name} went away before acknowledging the {kind} ({exc})") from None
        ack = done(snap) if snap is not None else None
        if ack is not None:
            return ack
        if snap is not None and snap.status != "live":
            raise ControlError(f"{model.name} stopped answering (status {snap.status}) before acknowledging the {kind}")
        if time.monotonic() >= deadline:
            late = "; its process runs but its heartbeat is late (stopped or overloaded)" if snap and snap.late else ""
            raise AckTimeout(f"{model.name} did not acknowledge the {kind} within {wait:g} s{late}", pending)
        time.sleep(_pause(looks, deadline - time.monotonic()))
        looks += 1


def limit_percent_base(model: ModelSnapshot) -> tuple[int | None, str]:
    """What a percentage limit of ``model`` (``30%``) is taken of, and a note when the model does not say it.

    Its own device capacity; else (host backend) the host capacity; else (an upstream segment, which
    does not say its device) device 0's NVML total, with the note that says so; else its device's
    NVML total. ``(None, "")`` when unknown. Raises :class:`~kvcached_core.interop.legacy.NoDeviceTotal`
    for an upstream segment when NVML cannot tell the total. kvctl limit and kvtop's dialog both use it.
    """
    if model.device_capacity:
        return model.device_capacity, ""
    if model.backend == "host":
        try:
            return settings().host_capacity_bytes, ""
        except ConfigError:
            return None, ""
    if model.legacy:
        return percent_base()
    from ..backends import nvml

    gpus = nvml.probe([model.device])
    return (gpus[0].total_bytes if gpus else None), ""


def request_limit(name: str | ModelSnapshot, limit_bytes: int | None, *, wait: float = DEFAULT_WAIT_S) -> Ack:
    """Set (or lift, with None) a model's limit; return its acknowledgement once it applied the revision.

    ``wait=0`` returns at once with status ``pending``. Raises ControlError, AckTimeout, ModelNotFound.
    """
    problem = L.limit_problem(limit_bytes)
    if problem is not None:
        raise ControlError(problem)
    model = _target(name)
    if model.status == "legacy":
        refusal = limit_refusal(model.name, limit_bytes)
        if refusal is not None:
            raise ControlError(refusal)
        assert limit_bytes is not None
        try:
            _, used, _ = write_legacy_limit(Path(model.path), limit_bytes)
        except (OSError, ValueError) as exc:
            raise ControlError(f"cannot write the limit of {model.name}: {exc}") from None
        return Ack(model.name, "limit", "legacy", 0, limit_bytes, in_use=used)
    if model.status != "live":
        raise ControlError(f"{model.name} is {model.status}: its process is gone, nothing would apply the limit")
    started = time.monotonic()
    revision = write_request(Path(model.path), lambda mm: write_limit(mm, limit_bytes))
    pending = Ack(model.name, "limit", "pending", revision, limit_bytes)
    if wait <= 0:
        return pending

    def done(snap: ModelSnapshot) -> Ack | None:
        if snap.applied_revision > revision:  # another controller's later request is what holds now
            return Ack(snap.name, "limit", "superseded", revision, snap.limit_bytes,
                       latency_s=time.monotonic() - started, superseded_by=snap.applied_revision,
                       superseding_status=snap.limit_status)
        if snap.applied_revision == revision:
            return Ack(snap.name, "limit", snap.limit_status, revision, snap.limit_bytes,
                       latency_s=time.monotonic() - started)
        return None

    return _wait(model, done, wait, "limit", pending, started)


def request_trim(name: str | ModelSnapshot, *, wait: float = DEFAULT_WAIT_S) -> Ack:
    """Ask a live model to unmap its reserved pages now; return the bytes it returned."""
    model = _target(name)
    if model.legacy:
        raise ControlError(f"{model.name} is an upstream kvcached segment: it cannot be trimmed from outside")
    if model.status != "live":
        raise ControlError(f"{model.name} is {model.status}: its process is gone, nothing to trim")
    started = time.monotonic()
    seq = bump_sequence(Path(model.path), L.TRIM_REQ_OFF)
    pending = Ack(model.name, "trim", "pending", seq)
    if wait <= 0:
        return pending

    def done(snap: ModelSnapshot) -> Ack | None:
        if snap.trim_ack_seq >= seq:
            return Ack(snap.name, "trim", "trimmed", snap.trim_ack_seq, snap.limit_bytes,
                       bytes_returned=snap.trim_bytes, latency_s=time.monotonic() - started)
        return None

    return _wait(model, done, wait, "trim", pending, started)
