"""The controller's side of sleep and wake: write a sleep request, wait for the model's answer.

Requests are revisioned like limits: the later of two controllers wins, and the earlier one is
answered ``superseded`` with what the model did instead.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from ..segment import layout as L
from ..segment.control_io import write_sleep
from ..segment.reader import read_segment
from ..segment.snapshot import ModelSnapshot, SleepInfo
from .requests import DEFAULT_WAIT_S, Ack, ControlError, _target, _wait, write_request

ACTIONS = {"sleep": L.SLEEP_SOON, "sleep_now": L.SLEEP_NOW, "wake": L.SLEEP_WAKE, "policy": L.SLEEP_POLICY_ONLY}


def sleep_problem(model: ModelSnapshot) -> str | None:
    """Why ``model`` cannot be put to sleep or woken; None when it can."""
    if model.legacy or model.sleep is None:
        return f"{model.name} is an upstream kvcached segment: it cannot sleep"
    if model.status != "live":
        return f"{model.name} is {model.status}: its process is gone, nothing would sleep"
    if not model.sleep.capable:
        return f"{model.name} cannot sleep: its engine ({model.engine or 'unknown'}) registered no sleep handler"
    return None


def after_idle_ms(seconds: float) -> int:
    """The after-idle policy of ``seconds`` as the whole milliseconds a model holds; ControlError when no model
    can hold it: from ``SLEEP_IDLE_MIN_MS`` (100 ms; shorter, a busy model would sleep between two requests)
    to ``MAX_AFTER_IDLE_MS`` (366 days)."""
    seconds = float(seconds)
    if math.isnan(seconds) or seconds < 0:
        raise ControlError(f"an after-idle time must be a duration of at least {L.SLEEP_IDLE_MIN_MS} ms, "
                           f"not {seconds:g} s")
    if seconds * 1000 > L.MAX_AFTER_IDLE_MS:  # inf too
        raise ControlError(f"an after-idle time of {seconds:g} s is beyond the longest, "
                           f"{L.MAX_AFTER_IDLE_MS // 3_600_000}h (366 days); off removes the policy")
    ms = round(seconds * 1000)
    if ms < L.SLEEP_IDLE_MIN_MS:
        raise ControlError(f"an after-idle time of {seconds * 1000:g} ms is below the shortest, "
                           f"{L.SLEEP_IDLE_MIN_MS}ms (a busy model would sleep between two requests); "
                           "to sleep now, leave out --after-idle")
    return ms


def request_sleep(name: str | ModelSnapshot, action: str, *, after_idle_s: float | None | bool = False,
                  wait: float = DEFAULT_WAIT_S, until_done: bool = False) -> Ack:
    """Ask a model to sleep (``sleep``, ``sleep_now``), wake (``wake``) or only change its after-idle
    policy (``policy``). ``after_idle_s``: seconds, None to remove the policy, False to leave it.

    Returns once the model took the request (``until_done``: once it is asleep or awake), with status
    the model's state then (``superseded`` when a later request replaced this one; for a sleep that a
    request already ended, ``woken``: it slept, releasing ``bytes_returned`` in ``latency_s``, then a
    request woke it). ``wait=0`` returns ``pending`` at once. Raises ControlError (also when the engine's
    handler refused the request: it raised), AckTimeout, ModelNotFound.
    """
    code = ACTIONS[action]
    if after_idle_s is False:
        idle_ms = L.SLEEP_IDLE_KEEP
    elif after_idle_s is None:
        idle_ms = L.SLEEP_IDLE_OFF
    else:
        idle_ms = after_idle_ms(after_idle_s)
    model = _target(name)
    problem = sleep_problem(model)
    if problem is not None:
        raise ControlError(problem)
    started = time.monotonic()
    before = _last_sleep(model)
    revision = write_request(Path(model.path), lambda mm: write_sleep(mm, code, idle_ms))
    pending = Ack(model.name, action, "pending", revision)
    if wait <= 0:
        return pending
    target = {"sleep": "asleep", "sleep_now": "asleep", "wake": "awake"}.get(action)

    def done(snap: ModelSnapshot) -> Ack | None:
        info = snap.sleep
        if info is None or info.acked_revision < revision:
            return None
        if info.acked_revision > revision:
            return Ack(snap.name, action, "superseded", revision, bytes_returned=info.slept_bytes,
                       latency_s=time.monotonic() - started, superseded_by=info.acked_revision,
                       superseding_status=info.state, after_idle_s=info.after_idle_s)
        if _refused(Path(snap.path), revision):
            verb = {"sleep_now": "sleep now", "policy": "change its after-idle policy"}.get(action, action)
            raise ControlError(f"{snap.name} refused to {verb}: its engine's sleep handler failed (its log says why); "
                               f"it stays {info.state}")
        if target is not None and not info.capable:
            raise ControlError(f"{snap.name} cannot sleep: its engine withdrew its sleep handler")
        if target == "asleep" and info.state == "awake":  # taken, and awake again: a request woke it
            return _woken(snap.name, action, revision, info, before, time.monotonic() - started)
        if until_done and target is not None and info.state != target:
            return None
        return Ack(snap.name, action, info.state, revision, bytes_returned=info.slept_bytes,
                   latency_s=info.took_s if info.state == "asleep" and target == "asleep"
                   else time.monotonic() - started, after_idle_s=info.after_idle_s)

    return _wait(model, done, wait, action.replace("_", " "), pending, started)


def _refused(path: Path, revision: int) -> bool:
    """Whether the model's engine refused request ``revision`` (``layout.SLEEP_REFUSED_OFF``, stored before the
    acknowledgement that was just read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        raw = os.pread(fd, 8, L.SLEEP_REFUSED_OFF)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(raw) == 8 and L.U64.unpack(raw)[0] == revision


def _last_sleep(model: ModelSnapshot) -> tuple[int, float] | None:
    """(bytes released, time taken) of the model's last sleep, as it reads just before a request."""
    try:
        info = read_segment(Path(model.path)).sleep
    except (BlockingIOError, OSError, ValueError):
        info = model.sleep
    return None if info is None else (info.slept_bytes, info.took_s)


def _woken(name: str, action: str, revision: int, info: SleepInfo, before: tuple[int, float] | None,
           waited_s: float) -> Ack:
    """The answer to a sleep the model took but that a request has already ended: ``woken`` (it slept,
    releasing ``bytes_returned`` in ``latency_s``, then woke) when its last sleep's figures changed since
    the request; ``awake`` (a request came before it slept: nothing released) when they did not."""
    if (info.slept_bytes, info.took_s) != before:
        return Ack(name, action, "woken", revision, bytes_returned=info.slept_bytes, latency_s=info.took_s,
                   after_idle_s=info.after_idle_s)
    return Ack(name, action, "awake", revision, latency_s=waited_s, after_idle_s=info.after_idle_s)
