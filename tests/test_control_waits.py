"""Controllers' waits: long waits end as asked, and a sleep's answer says what the model did."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from conftest import ROOT, child_env, freeze, kvctl, wait_for

from kvcached_core import AckTimeout, request_limit, request_trim, snapshot
from kvcached_core.control.compact import request_compact
from kvcached_core.control.sleep import request_sleep

WAIT_S = 6.0  # past the ~2.5 s after which the old backoff overflowed
HANDLERS = """
m.set_sleep_handler(lambda action: None)
m.set_compact_handler(lambda moves: None)
"""


def _timed(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def test_long_waits_on_a_stopped_model_end_in_ack_timeout_after_the_asked_time(spawn_allocator) -> None:
    """Every controller, in this process and as kvctl processes, asks a stopped model at once and waits 6 s."""
    proc = spawn_allocator("m1", script=HANDLERS)
    calls: dict[str, Callable[[], object]] = {
        "trim": lambda: request_trim("m1", wait=WAIT_S),
        "limit": lambda: request_limit("m1", 50 << 20, wait=WAIT_S),
        "sleep": lambda: request_sleep("m1", "sleep", wait=WAIT_S, until_done=True),
        "compact": lambda: request_compact("m1", wait=WAIT_S),
    }
    wait = f"{WAIT_S:g}"
    commands = {"trim": ["trim", "m1", "--wait", wait], "limit": ["limit", "m1", "50MiB", "--wait", wait],
                "sleep": ["sleep", "m1", "--wait", wait], "compact": ["compact", "m1", "--wait", wait]}
    freeze(proc.pid)
    try:
        results: dict[str, tuple[BaseException | None, float]] = {}
        threads = [threading.Thread(target=lambda k=k, c=c: results.__setitem__(k, _timed(c))) for k, c in calls.items()]
        started = time.monotonic()
        children = {k: subprocess.Popen([sys.executable, "-m", "kvtop.cli", *args], cwd=ROOT, env=child_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for k, args in commands.items()}
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        answers = {k: (*child.communicate(timeout=120), child.returncode) for k, child in children.items()}
        took = time.monotonic() - started
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    for kind, (exc, seconds) in results.items():
        assert isinstance(exc, AckTimeout), f"{kind}: {exc!r}"
        assert seconds >= WAIT_S and f"within {wait} s" in str(exc), (kind, seconds, str(exc))
    for kind, (out, err, code) in answers.items():
        assert code == 1 and out == "", (kind, code, out, err)
        assert err.count("\n") == 1 and "did not acknowledge" in err and f"within {wait} s" in err, (kind, err)
    assert took >= WAIT_S


# An engine under steady traffic: a request every few ms. Asked to sleep, it lets its running requests
# finish, frees its blocks and says ready; the requests that queued meanwhile wake it at once.
BUSY_ENGINE = """
import threading, time
held = m.alloc(8)
draining = threading.Event()
def handler(action):
    if action.startswith("sleep"):
        draining.set()
        def drain():
            global held
            time.sleep(0.2)  # the running requests finish
            m.free(held)
            held = []
            m.sleep.ready()
            m.sleep.wake()  # the first queued request wakes it
        threading.Thread(target=drain).start()
    else:
        held.extend(m.alloc(8))
        draining.clear()
def traffic():
    while True:
        time.sleep(0.002)
        if not draining.is_set():
            m.free(m.alloc(1))
m.set_sleep_handler(handler)
threading.Thread(target=traffic, daemon=True).start()
"""


@pytest.mark.parametrize("how", ["core", "kvctl"])
def test_sleep_wait_under_steady_traffic_says_it_slept_then_woke(spawn_allocator, how: str) -> None:
    """Asleep for the microseconds between ready() and wake(): the answer is that it slept, then woke (or,
    when a read falls in between, that it is asleep), with the bytes it released, never a timeout."""
    spawn_allocator("eng", script=BUSY_ENGINE)
    for _ in range(3):
        mapped = wait_for(lambda: snapshot("eng").mapped_bytes, what="the engine's blocks")
        if how == "core":
            ack = request_sleep("eng", "sleep", wait=10, until_done=True)
            assert ack.status in ("woken", "asleep") and ack.bytes_returned >= mapped > 0 and ack.latency_s > 0
        else:
            result = kvctl("sleep", "eng", "--wait", "--timeout", "10")
            assert result.exit_code == 0, result.stderr
            assert re.fullmatch(r"eng: (slept \(released \S+ \S+ in [\d.]+ ms\), then woken by a request"
                                r"|asleep, released \S+ \S+ in [\d.]+ ms)\n", result.stdout), result.stdout
    wait_for(lambda: snapshot("eng").mapped_bytes, what="the engine's blocks")
    answer = json.loads(kvctl("sleep", "eng", "--wait", "--timeout", "10", "--json").stdout)
    assert answer["slept_bytes"] > 0 and answer == {**answer, "action": "sleep"}
    assert answer["state"] == "asleep" or answer == {**answer, "state": "awake", "woken": True}
