"""Admission under a shared budget: an elastic transformers engine admits as a static one of the same memory does.

One fixed request stream runs twice through transformers' continuous batching on CPU (tiny random Llama):

- static: plain transformers, a cache of ``SHARE`` blocks (plus its two padding blocks);
- elastic: the same engine on kvcached (host backend), a cache of ``4 x SHARE`` blocks of address space under a
  ``KVCACHED_HOST_CAPACITY`` budget equal to the static cache's bytes.

Both are counted the same way (transformers' scheduler, wrapped at its class): the mean requests per step over the
run. With the same memory the elastic engine must admit at least as many.

And the room an engine admits by under a shared budget counts the other models' warm pools, which a reclaim gives
first and at once: memory only its owner could use is no reason to hold a request back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from budget_engine import BLOCK_BYTES, MIB, PAGE_TOKENS, budget_engine, finished, pooled_donor  # noqa: E402
from test_plugin_transformers_cb import needs_cb  # noqa: E402

import kvcached_core as kc  # noqa: E402
from kvcached_transformers import cb  # noqa: E402
from kvcached_transformers.tiny import random_prompts, tiny_llama  # noqa: E402

pytestmark = needs_cb  # this transformers' continuous batching is supported

SHARE = 10  # the static share in blocks; with its 2 padding blocks 12 blocks = 6 MiB = 3 pages
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512)


def stream() -> list[list[int]]:
    """12 requests of 230-500 prompt tokens (1-2 blocks, and most cross a block while they decode)."""
    return random_prompts(12, seed=21, min_len=230, max_len=500)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Requests in every step transformers' scheduler builds (its class wrapped): the list fills as the run goes."""
    from transformers.generation.continuous_batching import scheduler

    steps: list[int] = []
    original = scheduler.FIFOScheduler.schedule_batch

    def schedule_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if result[0]:
            steps.append(len(result[0]))
        return result

    monkeypatch.setattr(scheduler.FIFOScheduler, "schedule_batch", schedule_batch)
    yield steps


def run(model: Any, prompts: list[list[int]], num_blocks: int) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=num_blocks, max_batch_tokens=512,
                                      max_requests_per_batch=8, scheduler_type="fifo")
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)
    assert len(out) == len(prompts) and all(r.error is None and len(r.generated_tokens) == NEW_TOKENS
                                            for r in out.values())


def test_an_elastic_engine_admits_as_many_requests_per_step_as_a_static_one_of_its_memory(
        model: Any, counted: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = stream()
    run(model, prompts, SHARE)
    static = list(counted)
    counted.clear()

    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", f"{(SHARE + 2) * BLOCK_BYTES}B")
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    handle = cb.install(model, name="admit-elastic")
    try:
        run(model, prompts, 4 * SHARE)
        stats = handle.stats
    finally:
        handle.close()
    elastic = list(counted)

    static_mean = sum(static) / len(static)
    elastic_mean = sum(elastic) / len(elastic)
    print(f"requests per step: static {static_mean:.2f} ({len(static)} steps), "
          f"elastic {elastic_mean:.2f} ({len(elastic)} steps); elastic stats {stats}")
    # One request one step late is the most a starved host may cost: beside a busy loop in the whole suite, the refill
    # thread once mapped a page a step late (582 of 583 requests on time, 'budget' refusals 6 instead of 4).
    assert sum(elastic) >= sum(static) - 1 and len(elastic) <= len(static) + 1, (static_mean, elastic_mean, stats)
    # The plugin's own count agrees with the scheduler's.
    assert stats.steps == len(elastic) and stats.step_requests == sum(elastic)


def test_other_models_warm_pools_are_room_the_engine_admits_by(model: Any, spawn_allocator: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8 MiB budget (4 pages): the engine's padding sectors on one page (two sectors of it free), another
    process's idle model with the other three pages in its warm pool. The engine's room counts them (old code: the two
    free sectors only), and two requests of three sectors each are admitted and served with the pool's pages."""
    prompts = random_prompts(2, seed=9, min_len=600, max_len=600)  # 3 blocks each, one prefill chunk each
    with budget_engine(monkeypatch, model, "pool-asker", 8) as (handle, manager_cb):
        pooled_donor(spawn_allocator, "pool-donor")
        assert kc.snapshot("pool-donor").mapped_bytes == 6 * MIB  # the budget is full
        manager = handle.manager
        assert manager is not None
        # Two free sectors of its own, and the other model's three pages of four sectors.
        assert manager.schedulable_blocks() == 2 + 3 * 4
        ids = manager_cb.add_requests(prompts, max_new_tokens=8)
        results = finished(manager_cb, ids)
        assert all(len(tokens) == 8 for tokens in results.values())
        given = kc.snapshot("pool-donor").pressure
        assert given.given_reserved > 0 and given.gave_total >= 2 * MIB  # the pages came from its warm pool


def test_a_running_request_waits_for_a_warm_pool_the_budget_can_give_instead_of_being_offloaded(
        model: Any, spawn_allocator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8 MiB budget (4 pages): the engine's padding sectors on one page, another process's idle model with the
    other three pages in its warm pool. Two requests of one sector each fill the engine's page; both cross into a
    second sector while they decode, which only the other model's pool can give. Their growth misses (the reclaim is
    asked then) and waits for it: nothing is offloaded (a preemption a static cache of this memory would not need),
    and both finish."""
    prompts = random_prompts(2, seed=5, min_len=240, max_len=250)  # one sector each; the 256th token needs another
    with budget_engine(monkeypatch, model, "grow-asker", 24) as (handle, manager_cb):
        pooled_donor(spawn_allocator, "grow-donor")  # the budget is full
        ids = manager_cb.add_requests(prompts, max_new_tokens=24)
        results = finished(manager_cb, ids)
        assert all(len(tokens) == 24 for tokens in results.values())
        given = kc.snapshot("grow-donor").pressure
        assert given is not None and given.given_reserved > 0  # the growth was served by its warm pool
        traffic = handle._traffic
        assert traffic is not None and traffic[1].offloads == 0
