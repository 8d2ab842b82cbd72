"""The controller's side of compaction: ask a model to compact and wait for its answer.

A compact request is a sequence number in the CONTROL block (``layout.COMPACT_REQ_OFF``), taken
like a trim: the process's poller sees it, runs :meth:`KVCacheManager.compact` with the engine's
handler, and answers in the COMPACT words (acknowledged sequence, status, the bytes that
compaction copied and returned). A later request answered first answers this one too.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..segment import layout as L
from ..segment.snapshot import ModelSnapshot
from .requests import DEFAULT_WAIT_S, Ack, ControlError, _target, _wait, bump_sequence


def compact_problem(model: ModelSnapshot) -> str | None:
    """Why ``model`` cannot be compacted; None when it can."""
    if model.legacy or model.compaction is None:
        return f"{model.name} is an upstream kvcached segment: it cannot be compacted"
    if model.status != "live":
        return f"{model.name} is {model.status}: its process is gone, nothing would compact"
    if not model.compaction.capable:
        return (f"{model.name} cannot be compacted: its engine ({model.engine or 'unknown'}) registered no compact "
                "handler (nothing could copy its KV blocks)")
    return None


def request_compact(name: str | ModelSnapshot, *, wait: float = DEFAULT_WAIT_S) -> Ack:
    """Ask a live model to compact now; return its answer: status ``compacted`` with the bytes returned and
    copied (``pending`` with ``wait=0``). Raises ControlError (refused, or the engine's copy failed),
    AckTimeout, ModelNotFound."""
    model = _target(name)
    problem = compact_problem(model)
    if problem is not None:
        raise ControlError(problem)
    started = time.monotonic()
    seq = bump_sequence(Path(model.path), L.COMPACT_REQ_OFF)
    pending = Ack(model.name, "compact", "pending", seq)
    if wait <= 0:
        return pending

    def done(snap: ModelSnapshot) -> Ack | None:
        info = snap.compaction
        if info is None or info.acked_seq < seq:
            return None
        if info.status == "no handler":
            raise ControlError(f"{snap.name} cannot be compacted: its engine withdrew its compact handler")
        if info.status != "compacted":
            raise ControlError(f"{snap.name}: its engine's compaction {info.status} (nothing moved; its log says why)")
        return Ack(snap.name, "compact", "compacted", info.acked_seq, snap.limit_bytes,
                   bytes_returned=info.acked_returned, latency_s=time.monotonic() - started,
                   bytes_copied=info.acked_copied)

    return _wait(model, done, wait, "compaction", pending, started)
