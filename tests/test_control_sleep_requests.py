"""Sleep requests: a policy the model can hold, one whole record per request, the later request wins."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, child_env, kvctl, send, wait_for

from kvcached_core import ControlError, snapshot
from kvcached_core.control.requests import write_request
from kvcached_core.control.sleep import request_sleep
from kvcached_core.segment import layout as L

ENGINE = """
held = m.alloc(8)
def handler(action):
    global held
    if action.startswith("sleep"):
        m.free(held)
        held = []
        m.sleep.ready()
    else:
        held = m.alloc(8)
m.set_sleep_handler(handler)
"""


def _forge(path: Path, action: int, idle_ms: int) -> int:
    """Write a whole, well-checked sleep request as a controller would, with any policy value."""
    def write(mm: mmap.mmap) -> int:
        revision = L.SLEEP_CTL.unpack_from(mm, L.SLEEP_CTL_OFF)[0] + 1
        L.SLEEP_CTL.pack_into(mm, L.SLEEP_CTL_OFF, revision, action, idle_ms, L.sleep_check(action, idle_ms, revision))
        return revision

    return write_request(path, write)


def test_kvctl_after_idle_says_the_milliseconds_the_model_holds(spawn_allocator) -> None:
    spawn_allocator("eng", script=ENGINE)
    result = kvctl("sleep", "eng", "--after-idle", "100.4ms")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "eng: after-idle policy set: sleep after 100 ms (0.1 s) without a request\n"
    assert snapshot("eng").sleep.after_idle_s == 0.1
    answer = json.loads(kvctl("sleep", "eng", "--after-idle", "5m", "--json").stdout)
    assert answer["after_idle_s"] == 300.0 == snapshot("eng").sleep.after_idle_s
    assert kvctl("sleep", "eng", "--after-idle", "off").stdout == "eng: after-idle policy removed\n"


@pytest.mark.parametrize("seconds", [0, 1e-7, 0.0994, -1, float("nan"), float("inf"), 2**63 / 1000, 367 * 86400])
def test_request_sleep_refuses_a_policy_no_model_can_hold(spawn_allocator, seconds: float) -> None:
    spawn_allocator("eng", script=ENGINE)
    with pytest.raises(ControlError, match="after-idle time"):
        request_sleep("eng", "policy", after_idle_s=seconds)
    assert snapshot("eng").sleep.acked_revision == 0  # nothing written


def test_the_allocator_keeps_its_policy_when_a_request_carries_one_no_controller_writes(spawn_allocator) -> None:
    """A well-checked record with a policy of 0 ms (or beyond a year) is answered, its policy left as it was."""
    spawn_allocator("eng", script=ENGINE)
    request_sleep("eng", "policy", after_idle_s=60)
    path = Path(snapshot("eng").path)
    for idle_ms in (0, 5, L.MAX_AFTER_IDLE_MS + 1, 2**63 - 1):
        revision = _forge(path, L.SLEEP_POLICY_ONLY, idle_ms)
        assert wait_for(lambda r=revision: snapshot("eng").sleep.acked_revision == r)
        assert snapshot("eng").sleep.after_idle_s == 60 and snapshot("eng").sleep.state == "awake"


def _half_write(path: Path, write: Callable[[mmap.mmap], None]) -> None:
    """What a controller killed part way through its write leaves: ``write`` under the controllers' lock, no poke."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, L.PAGE_MAP_OFF) as mm:
            fcntl.flock(fd, fcntl.LOCK_EX)
            write(mm)
    finally:
        os.close(fd)  # the lock goes with the descriptor, as it does with a killed process


def _asked(mm: mmap.mmap) -> int:
    return L.U64.unpack_from(mm, L.SLEEP_CTL_OFF)[0]


@pytest.mark.parametrize("left", ["revision-0", "body-only"])
def test_after_a_half_written_sleep_request_the_next_requests_apply(spawn_allocator, left: str) -> None:
    """revision-0: the record with its revision word 0, as a controller that wrote the record before its revision
    left it; body-only: a new action, policy and check without the revision word, as one writing the revision
    last leaves it. Neither is taken; each next request applies, none is answered superseded."""
    spawn_allocator("eng", script=ENGINE)
    for action in ("sleep_now", "wake", "sleep_now", "wake"):
        request_sleep("eng", action, wait=10, until_done=True)
    path = Path(snapshot("eng").path)

    def damage(mm: mmap.mmap) -> None:
        revision = _asked(mm) + 1
        check = L.sleep_check(L.SLEEP_NOW, L.SLEEP_IDLE_KEEP, revision)
        L.SLEEP_CTL.pack_into(mm, L.SLEEP_CTL_OFF, 0 if left == "revision-0" else _asked(mm), L.SLEEP_NOW,
                              L.SLEEP_IDLE_KEEP, check)

    _half_write(path, damage)
    request_sleep("eng", "policy", after_idle_s=False, wait=10)  # a poke: the allocator looks at the record
    assert snapshot("eng").sleep.state == "awake"  # the half-written sleep was not taken
    for action, state in (("sleep_now", "asleep"), ("wake", "awake"), ("sleep", "asleep"), ("wake", "awake")):
        ack = request_sleep("eng", action, wait=10, until_done=True)
        assert ack.status == state, ack
        assert snapshot("eng").sleep.acked_revision == ack.revision
    assert kvctl("sleep", "eng", "--after-idle", "5m").exit_code == 0
    assert snapshot("eng").sleep.after_idle_s == 300


def _kvctl_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtop.cli", *args], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(("first", "later", "state"), [("sleep", "wake", "awake"), ("wake", "sleep", "asleep")])
def test_the_later_of_two_kvctl_processes_wins_over_a_pending_request(spawn_allocator, first: str, later: str,
                                                                      state: str) -> None:
    """The first controller's request waits (the model's poller is held); the later one, which reads the model
    still in the state the first asks to leave, is written too and is what the model does."""
    proc = spawn_allocator("eng", script=ENGINE)
    if first == "wake":
        request_sleep("eng", "sleep", wait=10, until_done=True)
    path = Path(snapshot("eng").path)
    acked = snapshot("eng").sleep.acked_revision
    asked = lambda: L.U64.unpack_from(path.read_bytes(), L.SLEEP_CTL_OFF)[0]  # noqa: E731
    send(proc, "m._watch.lock.acquire()")  # the poller waits: both requests land before the model looks
    try:
        earlier = _kvctl_process(first, "eng", "--wait", "--timeout", "30")
        wait_for(lambda: asked() == acked + 1, timeout=30, what="the first controller's request")
        assert snapshot("eng").sleep.state == state  # as the later controller reads it: already what it asks
        second = _kvctl_process(later, "eng", "--wait", "--timeout", "30", "--json")
        wait_for(lambda: asked() == acked + 2, timeout=30, what="the later controller's request")
    finally:
        send(proc, "m._watch.lock.release()")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    answer = json.loads(out)
    assert answer["state"] == state and answer["revision"] == acked + 2 and "already" not in answer
    out, err = earlier.communicate(timeout=60)
    assert earlier.returncode == 0, err
    assert out == f"eng: a later request (revision {acked + 2}) replaced this one; the model is {state}\n"
    now = snapshot("eng").sleep
    assert now.state == state and now.acked_revision == acked + 2
