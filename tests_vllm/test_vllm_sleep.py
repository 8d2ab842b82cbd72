"""Sleep and wake with a real vLLM engine (``vllm serve``, the tiny model): kvctl sleep / wake, the
after-idle policy and the wake by the next request, tokens identical to plain vLLM.

Shares the session's server with test_vllm_plugin.py; every test leaves it awake, without a policy.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from kvcached_core.control.sleep import request_sleep
from kvcached_core.segment.pagemap import count_pages
from kvcached_core.segment.reader import snapshot
from kvcached_core.segment.snapshot import ModelSnapshot

from .conftest import BASELINE_TOKENS, LONG, NAME, SHORT
from .harness import ADDED, MAX_MODEL_LEN, Busy, Server, engine_stopped, kvctl, settled, wait_for

MiB = 1024 * 1024
LONG_BASE = len(SHORT)  # LONG's tokens start here in the baseline
# As long as the context allows (900-token prompts, 1148 more): they must still run when a sleep is asked, and
# while the requests sent after it arrive (a few seconds on an idle host).
RUNNING_TOKENS = MAX_MODEL_LEN - len(LONG[0])


@pytest.fixture
def awake_after(server: Server, ctl_env: dict[str, str]) -> Iterator[Server]:
    """The server, left awake and without an after-idle policy whatever the test did."""
    yield server
    kvctl("sleep", NAME, "--after-idle", "off", env=ctl_env, check=False)
    kvctl("wake", NAME, "--wait", env=ctl_env, check=False)


def model(env: dict[str, str], *, pages: bool = False) -> ModelSnapshot:
    return snapshot(NAME, directory=Path(env["KVCACHED_SHM_DIR"]), with_pages=pages)


def traffic(env: dict[str, str]) -> dict:
    (row,) = [r for r in json.loads(kvctl("list", "--json", env=env).stdout) if r["name"] == NAME]
    return row["traffic"]


def assert_nothing_mapped(m: ModelSnapshot) -> None:
    counts = count_pages(m.pages)
    assert m.mapped_bytes == 0 and counts.inuse == 0 and counts.reserved == 0, (m.mapped_bytes, counts)
    assert m.blocks_used == 0  # the engine's placeholder block went too


def test_requests_before_during_and_after_a_sleep_match_plain_vllm(
        awake_after: Server, ctl_env: dict[str, str], baseline: list[list[int]]) -> None:
    server = awake_after
    assert model(ctl_env).sleep.capable  # the plugin registered its handler
    before = [server.complete(p, BASELINE_TOKENS) for p in SHORT[:2]]
    assert before == baseline[:2]

    arrived_before = (model(ctl_env).traffic or pytest.fail("no traffic published")).prompt_tokens
    with ThreadPoolExecutor(max_workers=8) as pool:
        # Long requests run while the sleep is asked for: they finish first (draining).
        running = [pool.submit(server.complete, p, RUNNING_TOKENS) for p in LONG[:4]]
        # All four scheduled (blocks_used alone is no sign: an earlier test's cached blocks count there): seen
        # running together, or all four arrived with none waiting and some still running (a reader starved of
        # the CPU on a loaded host may miss the moment all four run at once).
        four = sum(map(len, LONG[:4]))
        wait_for(lambda: (t := model(ctl_env).traffic) is not None and (
            t.running == 4 or (t.prompt_tokens - arrived_before >= four and t.waiting == 0 and t.running > 0)),
            every=0.005)
        # Requests sent while it drains wait in vLLM's queue: none rejected, none scheduled. The engine is stopped
        # from here until the sleep is asked and its API server has passed both on (its log says so): continued,
        # the engine takes the sleep (its poller stops new requests being scheduled at once) and the two requests
        # together, so the drain cannot end before they reach it. Asked after the look above, a starved test once
        # saw the running requests all done 0.23 s after the sleep was asked, before the two arrived. Asked from
        # this process (kvctl sleep is tested below and in tests/).
        with engine_stopped(server):
            asked = request_sleep(model(ctl_env), "sleep", wait=0)
            added = server.log.read_text().count(ADDED)
            during = [pool.submit(server.complete, p, BASELINE_TOKENS) for p in SHORT[2:4]]
            wait_for(lambda: server.log.read_text().count(ADDED) >= added + 2 or any(f.done() for f in during))
        asked_at = time.monotonic()
        assert asked.status == "pending", asked
        # Once the sleep is taken, they reach vLLM's queue while it drains (or is asleep by then); one that came
        # after the drain ended would rightly wake the model, and this test would prove nothing: say so.
        try:
            queued = wait_for(lambda: (m := model(ctl_env)).traffic is not None
                              and m.sleep.acked_revision >= asked.revision
                              and (m.traffic.waiting == 2 or m.sleep.state == "awake") and m, every=0.005)
        except AssertionError:
            m = model(ctl_env)
            pytest.fail(f"the two requests sent while it drained never seen waiting: {m.sleep}, {m.traffic}")
        assert queued.sleep.state != "awake" and queued.traffic is not None and queued.traffic.waiting == 2, (
            f"the drain ended before the requests sent during it arrived ({time.monotonic() - asked_at:.2f} s "
            f"after the sleep was asked; running requests done: {[f.done() for f in running]})")
        asleep = wait_for(lambda: (m := model(ctl_env, pages=True)).sleep.state == "asleep" and m)
        got_running = [f.result(timeout=120) for f in running]  # they finished: the sleep waited for them
        assert asleep.sleep.slept_bytes > 0
        assert_nothing_mapped(asleep)
        time.sleep(1.0)
        assert not any(f.done() for f in during)
        assert traffic(ctl_env)["waiting"] == 2
        woke = json.loads(kvctl("wake", NAME, "--wait", "--json", env=ctl_env).stdout)
        assert woke["state"] == "awake"
        got_during = [f.result(timeout=300) for f in during]
    assert got_during == baseline[2:4]
    assert [r[:BASELINE_TOKENS] for r in got_running] == baseline[LONG_BASE:LONG_BASE + 4]
    after = [server.complete(p, BASELINE_TOKENS) for p in SHORT[4:6]]
    assert after == baseline[4:6]


def test_sleep_releases_the_kv_memory_of_the_worker(awake_after: Server, ctl_env: dict[str, str],
                                                    baseline: list[list[int]]) -> None:
    server = awake_after
    assert [server.complete(p, BASELINE_TOKENS) for p in LONG[4:6]] == baseline[LONG_BASE + 4:LONG_BASE + 6]
    m = settled(NAME, Path(ctl_env["KVCACHED_SHM_DIR"]))  # what the sleep will release, the refill landed
    assert m.mapped_bytes >= 3 * m.bundle_bytes
    worker = server.worker()
    rss_awake = worker.memory_info().rss
    ack = json.loads(kvctl("sleep", NAME, "--wait", "--json", env=ctl_env).stdout)
    assert ack["state"] == "asleep" and ack["slept_bytes"] == m.mapped_bytes, (ack, m.mapped_bytes)
    assert_nothing_mapped(model(ctl_env, pages=True))
    drop = rss_awake - worker.memory_info().rss
    # The reserve-free floor: every mapped byte goes back, not only what a trim would return.
    assert drop >= 0.8 * m.mapped_bytes, f"worker RSS fell by {drop / MiB:.1f} of {m.mapped_bytes / MiB:.1f} MiB"
    again = kvctl("sleep", NAME, env=ctl_env)
    assert "already asleep" in again.stdout


def test_sleep_now_preempts_running_requests_which_run_again_after_the_wake(
        awake_after: Server, ctl_env: dict[str, str], baseline: list[list[int]]) -> None:
    server = awake_after
    before = model(ctl_env).traffic or pytest.fail("no traffic published")
    with ThreadPoolExecutor(max_workers=4) as pool:
        # Sent with the engine stopped, and continued once its API server has passed all four on (its log says
        # so): this process, which continues it, then looks at once, from their first step on. Sent to a running
        # engine, beside a busy loop all four once ran out before a starved look saw them arrived.
        with engine_stopped(server):
            added = server.log.read_text().count(ADDED)
            running: list[Future] = [pool.submit(server.complete, p, RUNNING_TOKENS) for p in LONG[6:10]]
            wait_for(lambda: server.log.read_text().count(ADDED) >= added + 4)
        # All four running: arrived, none waiting, none finished. True from the last one's scheduling until the
        # first one ends (seconds), however late a reader starved of the CPU looks; running == 4 is the same span,
        # but a gauge a slow reader can miss.
        four = sum(map(len, LONG[6:10]))
        seen: list = []  # the last look, for the failure's message
        try:
            wait_for(lambda: (t := model(ctl_env).traffic) is not None and not seen.append(t)
                     and t.prompt_tokens - before.prompt_tokens >= four and t.waiting == 0
                     and t.finished == before.finished, every=0.005)
        except AssertionError:
            pytest.fail(f"the four never seen running together: before {before}, last look {seen[-1:]}")
        # Asked with the engine stopped, so that none of the four can end before the sleep comes (beside a busy loop
        # all four once did); continued, the engine falls asleep within a step or two. Asked from this process
        # (kvctl's own start takes about as long as these requests run).
        with engine_stopped(server):
            asked = request_sleep(model(ctl_env), "sleep_now", wait=0)
        assert asked.status == "pending"
        try:
            asleep = wait_for(lambda: (m := model(ctl_env, pages=True)).sleep.state == "asleep" and m)
        except AssertionError:
            m = model(ctl_env)
            pytest.fail(f"not asleep: {m.sleep}, traffic {m.traffic}, requests done {[f.done() for f in running]}")
        assert_nothing_mapped(asleep)
        shown = traffic(ctl_env)  # no step runs while asleep: the gauges were published as it fell asleep
        # Every request still running when the sleep came was preempted and waits for the wake (all four); one that
        # a drain would have let finish shows as finished instead, and none waits.
        preempted = shown["waiting"]
        assert shown["running"] == 0 and preempted >= 1, shown
        assert shown["preemptions"] - before.preemptions == preempted, shown
        assert shown["finished"] - before.finished == 4 - preempted, shown
        assert sum(f.done() for f in running) <= 4 - preempted  # the preempted ones are not answered
        kvctl("wake", NAME, env=ctl_env)
        got = [f.result(timeout=300) for f in running]
    assert [r[:BASELINE_TOKENS] for r in got] == baseline[LONG_BASE + 6:LONG_BASE + 10]  # recomputed


def test_after_idle_sleeps_the_engine_and_the_next_request_wakes_it(
        awake_after: Server, ctl_env: dict[str, str], baseline: list[list[int]]) -> None:
    server = awake_after
    assert server.complete(SHORT[0], BASELINE_TOKENS) == baseline[0]
    # Asked while streamed requests keep the engine busy: the policy cannot fall due before kvctl reads its answer,
    # however slowly kvctl starts and reads on a loaded host (idle since the request above, it could).
    busy = Busy(server, Path(ctl_env["KVCACHED_SHM_DIR"]), seed=60)
    try:
        out = kvctl("sleep", NAME, "--after-idle", "2s", "--json", env=ctl_env)
        assert busy.running()
    finally:
        busy.stop()
    assert json.loads(out.stdout)["state"] == "awake"  # a policy, not a sleep now (which would drain the streams)
    slept = wait_for(lambda: (m := model(ctl_env, pages=True)).sleep.state == "asleep" and m)
    assert slept.sleep.after_idle_s == 2.0
    assert_nothing_mapped(slept)
    sent = traffic(ctl_env)
    got = server.complete(SHORT[1], BASELINE_TOKENS)  # nothing else wakes it
    assert got == baseline[1]
    assert model(ctl_env).sleep.state in ("awake", "draining", "asleep")  # it may be going back to sleep already
    done = traffic(ctl_env)
    assert done["finished"] - sent["finished"] == 1
    assert done["prompt_tokens"] - sent["prompt_tokens"] == len(SHORT[1])
    assert done["generated_tokens"] - sent["generated_tokens"] == BASELINE_TOKENS
    # It went back to sleep on the policy once idle again.
    wait_for(lambda: model(ctl_env).sleep.state == "asleep")


def test_a_sleep_asked_while_requests_keep_coming_is_answered(awake_after: Server, ctl_env: dict[str, str],
                                                              baseline: list[list[int]]) -> None:
    """A wake that comes while the model still drains wins: it serves on, nothing is released twice."""
    server = awake_after
    results: list[list[int]] = []
    stop = threading.Event()

    def traffic_loop() -> None:
        while not stop.is_set():
            results.append(server.complete(SHORT[5], 8))

    thread = threading.Thread(target=traffic_loop)
    thread.start()
    try:
        wait_for(lambda: results)
        asked = json.loads(kvctl("sleep", NAME, "--json", env=ctl_env).stdout)
        # Taken: draining, or asleep, or already woken by the next request (it waited in the queue while the model
        # drained, then woke it): on a loaded host kvctl can read the answer after all three happened.
        assert asked["state"] in ("draining", "asleep") or asked.get("woken"), asked
        woke = json.loads(kvctl("wake", NAME, "--wait", "--json", env=ctl_env).stdout)
        assert woke["state"] == "awake"
        count = len(results)
        wait_for(lambda: len(results) >= count + 3)  # still serving after the wake
    finally:
        stop.set()
        thread.join(timeout=300)
    assert all(r == baseline[5][:8] for r in results)
