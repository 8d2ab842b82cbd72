"""Wait until a limit is applied: the memory is back under it, not merely acknowledged.

A lowered limit below what is in use is acknowledged at once as "deferred" and applies as
pages empty; :func:`wait_applied` polls the model's segment until it says "applied" for that
request, so a script can wait for the memory itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..fleet import ModelNotFound, snapshot
from ..segment.snapshot import ModelSnapshot
from .requests import Ack, ControlError

POLL_S = 0.05


class NotApplied(TimeoutError):
    """The limit was still not applied when the wait ended; ``model`` is the last snapshot read."""

    def __init__(self, message: str, model: ModelSnapshot):
        super().__init__(message)
        self.model = model


def _done(m: ModelSnapshot, ack: Ack) -> bool:
    if ack.status == "legacy":  # upstream segments carry no revision and never acknowledge: their figures say it
        return m.limit_bytes is not None and m.mapped_bytes <= m.limit_bytes
    if m.limit_revision > ack.revision or m.applied_revision > ack.revision:
        raise ControlError(f"{m.name}: revision {max(m.limit_revision, m.applied_revision)} replaced "
                           f"revision {ack.revision} while waiting for it to apply")
    return m.applied_revision >= ack.revision and m.limit_status in ("applied", "none")


def wait_applied(ack: Ack, timeout: float, *, progress: Callable[[ModelSnapshot, float], None] | None = None,
                 poll_s: float = POLL_S) -> ModelSnapshot:
    """Poll the model ``ack`` answered for until it applied that limit; return its snapshot then.

    ``progress(snapshot, seconds_left)`` is called after each read that is not done yet.
    Raises :class:`NotApplied` after ``timeout`` seconds, ControlError when the model goes away,
    goes stale, or another request replaces this one.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            m = snapshot(ack.name, with_pages=False)
        except (ModelNotFound, OSError, ValueError) as exc:
            raise ControlError(f"{ack.name} went away while waiting for its limit to apply ({exc})") from None
        if _done(m, ack):
            return m
        if m.status == "stale":
            raise ControlError(f"{m.name} went stale while waiting for its limit to apply")
        left = deadline - time.monotonic()
        if left <= 0:
            raise NotApplied(f"{m.name}: limit not applied within {timeout:g} s", m)
        if progress is not None:
            progress(m, left)
        time.sleep(min(poll_s, left))
