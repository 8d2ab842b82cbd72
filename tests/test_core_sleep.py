"""Sleep and wake: a controller in this process, an allocator with a sleep handler in a child process."""

from __future__ import annotations

import json
import time

from conftest import kvctl, send, wait_for

from kvcached_core import snapshot
from kvcached_core.control.sleep import request_sleep

# The child's "engine": it holds blocks; asked to sleep it frees them and says ready, asked to wake it
# takes its blocks again. "hold" keeps the blocks (running requests) until the test lets them go.
ENGINE = """
import threading
held = m.alloc(8)
log = []
hold = threading.Event()
def handler(action):
    global held
    log.append(action)
    if action.startswith("sleep"):
        def drain():
            global held
            if action == "sleep":
                hold.wait()
            m.free(held)
            held = []
            m.sleep.ready()
        threading.Thread(target=drain).start()
    else:
        held = m.alloc(8)
m.set_sleep_handler(handler)
"""


def test_sleep_unmaps_every_page_and_wake_lifts_it(spawn_allocator) -> None:
    proc = spawn_allocator("eng", script=ENGINE)
    before = snapshot("eng")
    assert before.mapped_bytes > 0 and before.sleep.state == "awake" and before.sleep.capable
    send(proc, "hold.set()")
    ack = request_sleep("eng", "sleep", wait=10, until_done=True)
    assert ack.status == "asleep" and ack.bytes_returned >= before.mapped_bytes  # the warm pool goes too
    m = snapshot("eng", with_pages=True)
    assert m.mapped_bytes == 0 and m.blocks_used == 0 and not any(p & (1 << 31) for p in m.pages)
    shown = json.loads(kvctl("show", "eng", "--json").stdout)["sleep"]
    assert shown == {"state": "asleep", "after_idle_s": None, "slept_bytes": ack.bytes_returned, "capable": True}
    again = kvctl("sleep", "eng")
    assert again.exit_code == 0 and "already asleep" in again.stdout
    woke = kvctl("wake", "eng", "--wait", "--json")
    assert woke.exit_code == 0 and json.loads(woke.stdout)["state"] == "awake"
    assert wait_for(lambda: snapshot("eng").blocks_used == 8)


def test_sleep_waits_for_running_requests_and_now_does_not(spawn_allocator) -> None:
    proc = spawn_allocator("eng", script=ENGINE)
    ack = request_sleep("eng", "sleep", wait=5)
    assert ack.status == "draining"  # the engine holds its blocks until its requests finish
    assert snapshot("eng").blocks_used == 8
    send(proc, "hold.set()")
    assert wait_for(lambda: snapshot("eng").sleep.state == "asleep")
    request_sleep("eng", "wake", wait=5, until_done=True)
    send(proc, "hold.clear()")
    result = kvctl("sleep", "eng", "--now", "--wait", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["state"] == "asleep" and snapshot("eng").mapped_bytes == 0


def test_after_idle_policy_sleeps_an_idle_model(spawn_allocator) -> None:
    proc = spawn_allocator("eng", script=ENGINE)
    send(proc, "hold.set()")
    result = kvctl("sleep", "eng", "--after-idle", "200ms")
    assert result.exit_code == 0, result.stderr
    assert wait_for(lambda: snapshot("eng").sleep.after_idle_s == 0.2)
    assert wait_for(lambda: snapshot("eng").sleep.state == "asleep", timeout=15)
    assert snapshot("eng").mapped_bytes == 0
    # The engine's first request wakes it; checked in the engine, as the 200 ms policy may put it back
    # to sleep before another process reads the segment.
    send(proc, "m.sleep.wake(); assert m.sleep.state == 0 and len(held) == 8")
    assert kvctl("sleep", "eng", "--after-idle", "off").exit_code == 0
    assert wait_for(lambda: snapshot("eng").sleep.after_idle_s is None)


def test_the_later_of_two_sleep_requests_wins(spawn_allocator) -> None:
    proc = spawn_allocator("eng", script=ENGINE)
    send(proc, "m._watch.lock.acquire()")  # the poller waits: both requests land before it looks
    first = request_sleep("eng", "sleep_now", wait=0)
    second = request_sleep("eng", "wake", wait=0)
    assert second.revision == first.revision + 1
    send(proc, "m._watch.lock.release()")
    late = request_sleep("eng", "policy", after_idle_s=False, wait=5)
    assert late.status == "awake"
    assert snapshot("eng").sleep.acked_revision == late.revision and snapshot("eng").blocks_used == 8


def test_kvctl_sleep_refuses_what_cannot_sleep(spawn_allocator) -> None:
    spawn_allocator("plain")
    before = snapshot("plain")
    result = kvctl("sleep", "plain")
    assert result.exit_code == 1 and "cannot sleep" in result.stderr and result.stderr.count("\n") == 1
    assert snapshot("plain").sleep.acked_revision == before.sleep.acked_revision == 0
    missing = kvctl("sleep", "nosuch")
    assert missing.exit_code == 1 and missing.stderr.count("\n") == 1
    bad = kvctl("sleep", "plain", "--after-idle", "soon")
    assert bad.exit_code == 2 and "not a duration" in bad.stderr
    assert kvctl("wake", "plain").exit_code == 1
    # --wait takes seconds as on limit, trim and compact; a word after it is the model (the older spelling)
    words = kvctl("sleep", "plain", "--wait", "soon")
    assert words.exit_code == 2 and "takes seconds, not 'soon'" in words.stderr and words.stderr.count("\n") == 1
    both = kvctl("sleep", "plain", "--wait", "5", "--timeout", "5")
    assert both.exit_code == 2 and "give one of them" in both.stderr
    older = kvctl("sleep", "--wait", "plain")  # the model after the flag: it reaches the model, which cannot sleep
    assert older.exit_code == 1 and "cannot sleep" in older.stderr
    assert snapshot("plain").sleep.acked_revision == 0


def test_sleep_state_reaches_watch_and_the_exporter(spawn_allocator) -> None:
    import csv
    import io

    from test_exporter import scrape, value

    from kvtop.serve.exporter import Exporter

    proc = spawn_allocator("eng", script=ENGINE)
    spawn_allocator("plain")
    send(proc, "hold.set()")
    request_sleep("eng", "sleep", wait=10, until_done=True)
    assert kvctl("sleep", "eng", "--after-idle", "5m").exit_code == 0
    watched = kvctl("watch", "--format", "csv", "--count", "1", "--interval", "0.05")
    records = {r["name"]: r for r in csv.DictReader(io.StringIO(watched.stdout))}
    assert records["eng"]["sleep_state"] == "asleep" and records["eng"]["sleep_after_idle_s"] == "300.0"
    assert records["plain"]["sleep_state"] == "awake" and records["plain"]["sleep_after_idle_s"] == ""
    rows = {line.split()[0]: line.split() for line in kvctl("list").stdout.splitlines()[1:] if line.strip()}
    assert "asleep" in rows["eng"] and "live" in rows["plain"]  # kvctl's status column, as kvtop's
    with Exporter("127.0.0.1", 0) as exporter:
        samples = scrape(exporter.url)
        assert value(samples, "kvcached_sleep_state", model="eng", state="asleep") == 1
        assert value(samples, "kvcached_sleep_state", model="eng", state="awake") == 0
        assert value(samples, "kvcached_model_info", model="eng", status="asleep") == 1
        assert value(samples, "kvcached_sleep_after_idle_seconds", model="eng") == 300
        assert value(samples, "kvcached_slept_bytes", model="eng") == snapshot("eng").sleep.slept_bytes > 0


def test_an_engine_that_keeps_stepping_is_not_idle(spawn_allocator) -> None:
    """Decode steps that take no new block still count: the engine publishes its traffic each step."""
    proc = spawn_allocator("eng", script=ENGINE + """
stepping = threading.Event()
def steps():
    i = 0
    while True:
        stepping.wait()
        i += 1
        m.publish_traffic(1, 0, 0, 10, i, 0, 1)
        time.sleep(0.02)
import time
threading.Thread(target=steps, daemon=True).start()
""")
    send(proc, "hold.set()")
    send(proc, "stepping.set()")
    assert kvctl("sleep", "eng", "--after-idle", "1s").exit_code == 0
    assert wait_for(lambda: snapshot("eng").sleep.after_idle_s == 1.0)
    time.sleep(3.0)  # three times the policy: no alloc, no free, but a step every 20 ms
    assert snapshot("eng").sleep.state == "awake"
    send(proc, "stepping.clear()")
    assert wait_for(lambda: snapshot("eng").sleep.state == "asleep", timeout=15)
