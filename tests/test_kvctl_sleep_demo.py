"""A demo model that sleeps stays asleep until a request reaches it, and kvctl sleep never answers ``asleep`` for a
model that is awake again.

The demo's own simulated users woke a sleeping model at its next burst of traffic: ``kvctl sleep --wait`` said
``asleep, released 130.0 MiB`` and a second later ``kvctl list`` showed it live, the recording never asleep.
Here a real allocator (host backend) runs the demo's traffic (:class:`kvtop.demo.fleet.DemoEngine`, stepped as
``python -m kvtop.demo.fleet`` steps it) and is put to sleep by kvctl through its segment."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
from conftest import kvctl, wait_for

import kvcached_core as kc
import kvcached_core.control
from kvtop.demo.fleet import DemoEngine, KiB

NAME = "demo-sleeper"


@pytest.fixture
def demo(shm_dir) -> Iterator[DemoEngine]:
    """A demo model's engine, as :func:`kvtop.demo.fleet.run_model` builds it, with its traffic under way."""
    with kc.KVCacheManager(NAME, num_blocks=4096, block_bytes=16 * KiB, num_layers=2, num_kv_buffers=2,
                           page_size=256 * KiB, engine="vllm", name=NAME) as manager:
        engine = DemoEngine(manager, random.Random(7))
        manager.set_sleep_handler(engine.on_sleep)
        wait_for(lambda: step(engine, "burst") and kc.snapshot(NAME).blocks_used > 0, 30, "its traffic")
        yield engine


def step(engine: DemoEngine, phase: str) -> bool:
    engine.step(phase)
    return True


def asleep() -> bool:
    m = kc.snapshot(NAME)
    return m.sleep is not None and m.sleep.state == "asleep"


def test_a_sleeping_demo_model_stays_asleep_through_its_bursts_until_a_request_wakes_it(demo: DemoEngine) -> None:
    asked = kvctl("sleep", NAME, "--wait", "0")  # the model drains as its steps run
    assert asked.exit_code == 0, asked.stderr
    wait_for(lambda: step(demo, "burst") and asleep(), 30, "the demo model asleep")
    for phase in ["burst"] * 200 + ["steady"] * 50 + ["idle"] * 10:  # 200 bursts: users arrive in all but ~none
        demo.step(phase)
        m = kc.snapshot(NAME)
        assert m.sleep is not None and m.sleep.state == "asleep", f"woken by its own simulated users ({phase})"
        assert (m.mapped_bytes, m.blocks_used, m.pages_inuse) == (0, 0, 0)
    assert demo.asleep and not demo.running
    assert kc.snapshot(NAME).sleep.acked_revision == 1  # type: ignore[union-attr]  # nothing else was asked

    blocks = demo.take_request(2)  # what the model's server does when a request reaches it (kvtop.demo.serve)
    assert blocks is not None and len(blocks) == 2
    m = kc.snapshot(NAME)
    assert m.sleep is not None and m.sleep.state == "awake" and m.blocks_used == 2
    demo.manager.free(blocks)
    wait_for(lambda: step(demo, "burst") and kc.snapshot(NAME).blocks_used > 0, 30, "its simulated users back")


@pytest.mark.parametrize("woken_by", ["request", "kvctl wake"])
def test_kvctl_sleep_never_answers_asleep_for_a_model_awake_again(woken_by: str, shm_dir, monkeypatch) -> None:
    """The model answers asleep, then is woken before kvctl prints: kvctl reads it once more and says what happened
    (the order is forced: the wake comes right after the model's answer is read)."""
    with kc.KVCacheManager("m1", name="m1", num_blocks=64, block_bytes=1 << 16, num_layers=1,
                           page_size=1 << 18) as m:
        def handler(action: str) -> None:
            if action.startswith("sleep"):  # nothing in use: ready at once (from a thread, as an engine does)
                threading.Thread(target=m.sleep.ready).start()

        m.set_sleep_handler(handler)
        answer = kvcached_core.control.request_sleep

        def answered_then_woken(*args: object, **kwargs: object) -> object:
            ack = answer(*args, **kwargs)  # type: ignore[arg-type]
            assert ack.status == "asleep"
            if woken_by == "request":
                blocks = m.alloc(1)  # a request's first block: the model wakes to map it
                assert blocks is not None
                m.free(blocks)  # the request ends; the model stays awake
            else:
                answer("m1", "wake", wait=10, until_done=True)
            return ack

        monkeypatch.setattr(kvcached_core.control, "request_sleep", answered_then_woken)
        done = kvctl("sleep", "m1", "--wait", "10")
        as_json = kvctl("sleep", "m1", "--wait", "10", "--json")
    assert done.exit_code == 0 and as_json.exit_code == 0, (done.stderr, as_json.stderr)
    assert "asleep" not in done.stdout
    if woken_by == "request":
        assert done.stdout.startswith("m1: slept (released ") and done.stdout.endswith(", then woken by a request\n")
        assert '"woken": true' in as_json.stdout and '"state": "awake"' in as_json.stdout
    else:
        assert done.stdout == "m1: a later request (revision 2) replaced this one; the model is awake\n"
        assert '"superseded": true' in as_json.stdout and '"state": "awake"' in as_json.stdout
