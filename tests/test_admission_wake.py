"""A transformers engine held back for room wakes when room comes, not at its loop's next 0.1 s poll.

transformers' generation loop, when it has nothing to schedule, waits on its ``_wake_up_loop`` event for at most
0.1 s. Here the engine (tiny random Llama, host backend) waits with one request that the shared budget holds back,
while another process's model holds the rest of the budget. That model then frees its blocks into its warm pool;
the engine's reclaim takes them, and kvcached's room handler sets the event: the pass that admits the request
follows a wake-up, not a timed-out wait.

Memory another model gives back to the budget outside a reclaim (a trim, the model closing) wakes the engine too:
that model's ledger pokes the segments that publish ``wanted_bytes > 0``, and the engine's poller, poked, calls
the room handler once the budget's room grew.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import send, wait_for  # noqa: E402
from test_plugin_transformers_cb import needs_cb  # noqa: E402

import kvcached_core as kc  # noqa: E402
from kvcached_transformers import cb  # noqa: E402
from kvcached_transformers.tiny import random_prompts, tiny_llama  # noqa: E402

pytestmark = needs_cb  # this transformers' continuous batching is supported

PAGE_TOKENS = 256  # one block: 2 layers x K,V x 4 heads x 32 x fp32 x 256 tokens = 512 KiB, 4 per 2 MiB page
NEW_TOKENS = 8
MIB = 1 << 20


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512)


class CountedEvent(threading.Event):
    """transformers' wake-up event, recording each wait's outcome (True: set, False: timed out) and the steps
    the engine had built by then."""

    def __init__(self, steps: Any) -> None:
        super().__init__()
        self.steps = steps
        self.waits: list[tuple[bool, int]] = []
        self.patience: float | None = None  # set: each wait lasts this long unless set (the poll cannot win a race)

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(self.patience or timeout)
        self.waits.append((woke, self.steps()))
        return woke


def test_an_engine_held_back_for_room_wakes_when_a_reclaim_brings_it(model: Any, spawn_allocator: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "8MiB")  # 4 pages
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    prompt = random_prompts(1, seed=9, min_len=600, max_len=600)[0]  # 3 blocks, in one prefill chunk
    handle = cb.install(model, name="room-asker")
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=16, max_batch_tokens=1024,
                                      max_requests_per_batch=4, scheduler_type="fifo")
    manager_cb = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    event = CountedEvent(lambda: handle.stats.steps)
    manager_cb._wake_up_loop = event
    manager_cb.start()
    try:
        # The engine's padding sectors take one page (two of its four sectors free); the other model the rest.
        wait_for(lambda: handle.manager is not None and kc.snapshot("room-asker").mapped_bytes == 2 * MIB,
                 what="the engine's padding page")
        donor = spawn_allocator("room-donor", num_blocks=64, block_bytes=512 * 1024, num_layers=1, num_kv_buffers=1,
                                page_size=2 * MIB, env={"KVCACHED_MAX_RESERVED_PAGES": "10"})
        send(donor, "held = m.alloc(12)")
        send(donor, "assert held is not None")
        rid = manager_cb.add_request(prompt, max_new_tokens=NEW_TOKENS)
        # Held back: three sectors wanted, two free, the budget full; the loop polls meanwhile.
        wait_for(lambda: handle.stats.refused["budget"] >= 3, what="the request to be held back for room")
        assert handle.stats.steps == 0 and sum(1 for woke, _ in event.waits if not woke) >= 2
        # The other model's blocks go to its warm pool: the budget is as full as before, the engine's reclaim
        # takes a page of that pool and the engine maps it.
        send(donor, "m.free(held)")
        got = None
        deadline = time.monotonic() + 60
        while got is None or not got.is_finished():
            assert time.monotonic() < deadline, "the request never ran"
            got = manager_cb.get_result(rid, timeout=1)
        assert got.error is None and len(got.generated_tokens) == NEW_TOKENS
        assert kc.snapshot("room-asker").pressure.took_total >= 2 * MIB
        # The pass that admitted it came right after a wake-up (the event set), not after a 0.1 s poll ran out.
        before_first_step = [woke for woke, steps in event.waits if steps == 0]
        assert before_first_step and before_first_step[-1], event.waits[-8:]
        manager = handle.manager
        assert manager is not None and getattr(manager, "room_wakes", 0) >= 1
    finally:
        manager_cb.stop(block=True, timeout=30)
        handle.close()


@pytest.mark.parametrize("how", ["trim", "close"])
def test_an_engine_held_back_for_room_wakes_when_another_model_gives_memory_back(
        how: str, model: Any, spawn_allocator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's model returns memory to the budget outside any reclaim: its warm pool, which its ``min``
    keeps from reclaim, trimmed by a controller; or its blocks in use, when it closes. No reclaim of the engine's
    can bring that room; the engine's loop is woken by the room handler, not by its poll."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcached_core.control import request_policy, request_trim

    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "8MiB")  # 4 pages
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    prompt = random_prompts(1, seed=9, min_len=600, max_len=600)[0]  # 3 blocks, in one prefill chunk
    name = f"room-waiter-{how}"
    handle = cb.install(model, name=name)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=16, max_batch_tokens=1024,
                                      max_requests_per_batch=4, scheduler_type="fifo")
    manager_cb = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    event = CountedEvent(lambda: handle.stats.steps)
    manager_cb._wake_up_loop = event
    manager_cb.start()
    try:
        wait_for(lambda: handle.manager is not None and kc.snapshot(name).mapped_bytes == 2 * MIB,
                 what="the engine's padding page")
        donor = spawn_allocator(f"room-giver-{how}", num_blocks=64, block_bytes=512 * 1024, num_layers=1,
                                num_kv_buffers=1, page_size=2 * MIB, env={"KVCACHED_MAX_RESERVED_PAGES": "10"})
        send(donor, "held = m.alloc(12)")
        send(donor, "assert held is not None")
        if how == "trim":  # its three pages stay mapped in its warm pool, all under its min: no reclaim takes them
            request_policy(f"room-giver-{how}", min_bytes=6 * MIB)
            send(donor, "m.free(held)")
            assert kc.snapshot(f"room-giver-{how}").pages_reserved == 3
        rid = manager_cb.add_request(prompt, max_new_tokens=NEW_TOKENS)
        wait_for(lambda: handle.stats.refused["budget"] >= 3, what="the request to be held back for room")
        wait_for(lambda: kc.snapshot(name).pressure.wanted_bytes > 0, what="the engine to publish what it waits for")
        assert handle.stats.steps == 0
        manager = handle.manager
        assert manager is not None
        # From here the engine's loop waits until its event is set (or 30 s pass): a timed-out wait
        # before the admitting pass would be the poll finding the room, not the room handler.
        event.patience = 30.0
        wakes, waits = manager.room_wakes, len(event.waits)
        if how == "trim":
            request_trim(f"room-giver-{how}")
        else:
            send(donor, "m.close()")
        got = None
        deadline = time.monotonic() + 120
        while got is None or not got.is_finished():
            assert time.monotonic() < deadline, "the request never ran"
            got = manager_cb.get_result(rid, timeout=1)
        assert got.error is None and len(got.generated_tokens) == NEW_TOKENS
        assert manager.room_wakes > wakes
        after = [woke for woke, steps in event.waits[waits:] if steps == 0]
        assert after and all(after), event.waits[waits:]
        assert kc.snapshot(name).pressure.took_total == 0  # no reclaim brought it
    finally:
        event.patience = None
        event.set()  # a wait under way ends now
        manager_cb.stop(block=True, timeout=30)
        handle.close()
