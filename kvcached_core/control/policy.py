"""Set a model's memory policy from outside: ``min`` (bytes never reclaimed from it) and ``priority``.

One revisioned record in the segment's second control block (``layout.POLICY_CTL``: revision,
min, priority, check; the revision word last), acknowledged by the model's poller in its PRESSURE
block, as a limit is: a request replaced by another controller's later one says so.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..segment import layout as L
from ..segment.control_io import write_policy
from ..segment.snapshot import ModelSnapshot
from .requests import DEFAULT_WAIT_S, Ack, ControlError, _target, _wait, write_request

KEEP = object()  # a figure left as it is


def _priority_ok(priority: object) -> bool:
    return isinstance(priority, int) and not isinstance(priority, bool) and L.PRIORITY_MIN <= priority <= L.PRIORITY_MAX


def policy_problem(model: ModelSnapshot, min_bytes: int | None | object, priority: int | object) -> str | None:
    """Why this policy cannot be asked of ``model``; None when it can."""
    if model.legacy:
        return f"{model.name} is an upstream kvcached segment: it has no memory policy"
    if model.status != "live":
        return f"{model.name} is {model.status}: its process is gone, nothing would apply the policy"
    if model.pressure is None:
        return f"{model.name} publishes no memory policy (an older allocator)"
    if min_bytes is not KEEP and min_bytes is not None:
        if not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or min_bytes < 0:
            return f"a min is a whole number of bytes, at least 0, not {min_bytes!r}"
        if min_bytes > L.MAX_LIMIT_BYTES:
            return "a min cannot be larger than the largest size a segment holds (2^63-1 bytes)"
        limit = model.limit_bytes
        if limit is not None and min_bytes > limit:
            return (f"a min of {min_bytes} bytes is above {model.name}'s limit ({limit} bytes): "
                    "no reclaim could ever leave it that much; raise the limit first")
    if priority is not KEEP and not _priority_ok(priority):
        return f"a priority is a whole number from {L.PRIORITY_MIN} to {L.PRIORITY_MAX}, not {priority!r}"
    if min_bytes is KEEP and priority is KEEP:
        return "nothing to set: give --min, --priority or both"
    return None


def request_policy(name: str | ModelSnapshot, *, min_bytes: int | None | object = KEEP,
                   priority: int | object = KEEP, wait: float = DEFAULT_WAIT_S) -> Ack:
    """Set ``min`` (bytes; None: none) and/or ``priority`` of a live model; figures not given stay as they are.

    Returns the model's acknowledgement (status ``applied``, or ``superseded`` when another controller's
    later request replaced it; ``pending`` with ``wait=0``). Raises ControlError, AckTimeout, ModelNotFound.
    """
    model = _target(name)
    problem = policy_problem(model, min_bytes, priority)
    if problem is not None:
        raise ControlError(problem)
    raw_min = L.POLICY_MIN_KEEP if min_bytes is KEEP else (int(min_bytes) if min_bytes else L.POLICY_MIN_NONE)  # type: ignore[call-overload]
    raw_priority = L.POLICY_PRIORITY_KEEP if priority is KEEP else int(priority)  # type: ignore[arg-type]
    started = time.monotonic()

    revision = write_request(Path(model.path), lambda mm: write_policy(mm, raw_min, raw_priority))
    pending = Ack(model.name, "policy", "pending", revision)
    if wait <= 0:
        return pending

    def done(snap: ModelSnapshot) -> Ack | None:
        pressure = snap.pressure
        if pressure is None or pressure.policy_revision < revision:
            return None
        status = "applied" if pressure.policy_revision == revision else "superseded"
        return Ack(snap.name, "policy", status, revision, latency_s=time.monotonic() - started,
                   superseded_by=pressure.policy_revision if status == "superseded" else 0)

    return _wait(model, done, wait, "policy", pending, started)
