"""The controller's side of compaction: ask a model to compact and wait for its answer.

A compact request is a sequence number in the CONTROL block (``layout.COMPACT_REQ_OFF``), taken
like a trim: the process's poller sees it, runs :meth:`KVCacheManager.compact` with the engine's
handler, and answers in the COMPACT words: the acknowledged sequence and, for each of its last
few compactions that answered controllers, the requests it answered (first..last: requests that
arrived together are folded into one compaction) with its status and the bytes it copied and
returned, so each controller learns what its own request did, however many ask at once.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..segment import layout as L
from ..segment.snapshot import CompactInfo, ModelSnapshot
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
    copied by the compaction that answered it (see :func:`compact_answer`; ``pending`` with ``wait=0``). Raises ControlError (refused, or the engine's copy failed),
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
        return compact_answer(snap, info, seq, time.monotonic() - started)

    return _wait(model, done, wait, "compaction", pending, started)


def compact_answer(snap: ModelSnapshot, info: CompactInfo, seq: int, waited_s: float) -> Ack:
    """The answer to request ``seq``, which ``info`` acknowledges: its own compaction's (status ``compacted``), the
    one it was folded into with requests of other controllers (``answered_range`` names them), or ``answered``
    with no figures when its answer has left the allocator's record of the last ``layout.COMPACT_ANSWERS``."""
    answer = info.answer_for(seq)
    if answer is None:
        return Ack(snap.name, "compact", "answered", seq, latency_s=waited_s)
    if answer.status == "no handler":
        raise ControlError(f"{snap.name} cannot be compacted: its engine withdrew its compact handler")
    if answer.status != "compacted":
        raise ControlError(f"{snap.name}: its engine's compaction {answer.status} (nothing moved; its log says why)")
    return Ack(snap.name, "compact", "compacted", seq, snap.limit_bytes, bytes_returned=answer.bytes_returned,
               latency_s=waited_s, bytes_copied=answer.bytes_copied,
               answered_range=(answer.first_seq, answer.last_seq))
