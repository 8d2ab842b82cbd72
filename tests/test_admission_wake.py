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
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from budget_engine import MIB, budget_donor, budget_engine, finished  # noqa: E402
from conftest import send, wait_for  # noqa: E402
from test_plugin_transformers_cb import needs_cb  # noqa: E402

import kvcached_core as kc  # noqa: E402
from kvcached_transformers.tiny import random_prompts, tiny_llama  # noqa: E402

pytestmark = needs_cb  # this transformers' continuous batching is supported

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512)


class CountedEvent(threading.Event):
    """transformers' wake-up event, recording each wait's outcome (True: set, False: timed out) and the steps
    the engine (the plugin's ``handle``) had built by then."""

    def __init__(self, handle: Any) -> None:
        super().__init__()
        self.handle = handle
        self.waits: list[tuple[bool, int]] = []
        self.patience: float | None = None  # set: each wait lasts this long unless set (the poll cannot win a race)

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(self.patience or timeout)
        self.waits.append((woke, self.handle.stats.steps))
        return woke


def held_back(handle: Any) -> None:
    """Wait until the engine's request is held back for room: three sectors wanted, the budget refusing them."""
    wait_for(lambda: handle.stats.refused["budget"] >= 3, what="the request to be held back for room")


def test_an_engine_held_back_for_room_wakes_when_a_reclaim_brings_it(model: Any, spawn_allocator: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = random_prompts(1, seed=9, min_len=600, max_len=600)[0]  # 3 blocks, in one prefill chunk
    # The engine's padding sectors take one page (two of its four sectors free); the other model the rest.
    with budget_engine(monkeypatch, model, "room-asker", NEW_TOKENS, wake_up_loop=CountedEvent) as (handle, manager_cb):
        event = manager_cb._wake_up_loop
        donor = budget_donor(spawn_allocator, "room-donor")
        send(donor, "assert held is not None")
        rid = manager_cb.add_request(prompt, max_new_tokens=NEW_TOKENS)
        # Held back: three sectors wanted, two free, the budget full; the loop polls meanwhile.
        held_back(handle)
        assert handle.stats.steps == 0 and sum(1 for woke, _ in event.waits if not woke) >= 2
        # The other model's blocks go to its warm pool: the budget is as full as before, the engine's reclaim
        # takes a page of that pool and the engine maps it.
        send(donor, "m.free(held)")
        assert len(finished(manager_cb, [rid])[rid]) == NEW_TOKENS
        assert kc.snapshot("room-asker").pressure.took_total >= 2 * MIB
        # The pass that admitted it came right after a wake-up (the event set), not after a 0.1 s poll ran out.
        before_first_step = [woke for woke, steps in event.waits if steps == 0]
        assert before_first_step and before_first_step[-1], event.waits[-8:]
        manager = handle.manager
        assert manager is not None and getattr(manager, "room_wakes", 0) >= 1


@pytest.mark.parametrize("how", ["trim", "close"])
def test_an_engine_held_back_for_room_wakes_when_another_model_gives_memory_back(
        how: str, model: Any, spawn_allocator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's model returns memory to the budget outside any reclaim: its warm pool, which its ``min``
    keeps from reclaim, trimmed by a controller; or its blocks in use, when it closes. No reclaim of the engine's
    can bring that room; the engine's loop is woken by the room handler, not by its poll."""
    from kvcached_core.control import request_policy, request_trim

    prompt = random_prompts(1, seed=9, min_len=600, max_len=600)[0]  # 3 blocks, in one prefill chunk
    name = f"room-waiter-{how}"
    with budget_engine(monkeypatch, model, name, NEW_TOKENS, wake_up_loop=CountedEvent) as (handle, manager_cb):
        event = manager_cb._wake_up_loop
        try:
            donor = budget_donor(spawn_allocator, f"room-giver-{how}")
            send(donor, "assert held is not None")
            if how == "trim":  # its three pages stay mapped in its warm pool, all under its min: no reclaim takes them
                request_policy(f"room-giver-{how}", min_bytes=6 * MIB)
                send(donor, "m.free(held)")
                assert kc.snapshot(f"room-giver-{how}").pages_reserved == 3
            rid = manager_cb.add_request(prompt, max_new_tokens=NEW_TOKENS)
            held_back(handle)
            wait_for(lambda: kc.snapshot(name).pressure.wanted_bytes > 0,
                     what="the engine to publish what it waits for")
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
            assert len(finished(manager_cb, [rid], 120)[rid]) == NEW_TOKENS
            assert manager.room_wakes > wakes
            after = [woke for woke, steps in event.waits[waits:] if steps == 0]
            assert after and all(after), event.waits[waits:]
            assert kc.snapshot(name).pressure.took_total == 0  # no reclaim brought it
        finally:
            event.patience = None
            event.set()  # a wait under way ends now
