"""Admission under a shared budget: an elastic transformers engine admits as a static one of the same memory does.

One fixed request stream runs twice through transformers' continuous batching on CPU (tiny random Llama):

- static: plain transformers, a cache of ``SHARE`` blocks (plus its two padding blocks);
- elastic: the same engine on kvcached (host backend), a cache of ``4 x SHARE`` blocks of address space under a
  ``KVCACHED_HOST_CAPACITY`` budget equal to the static cache's bytes.

Both are counted the same way (transformers' scheduler, wrapped at its class): the mean requests per step over the
run. With the same memory the elastic engine must admit at least as many.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvcached_transformers import cb  # noqa: E402
from kvcached_transformers.cb.seams import UnsupportedTransformers, check_version  # noqa: E402
from kvcached_transformers.tiny import random_prompts, tiny_llama  # noqa: E402

try:
    check_version(transformers.__version__)
    SUPPORTED_HERE = True
except UnsupportedTransformers:
    SUPPORTED_HERE = False
pytestmark = pytest.mark.skipif(not SUPPORTED_HERE, reason=f"transformers {transformers.__version__} is outside "
                                f"the continuous batching range")

PAGE_TOKENS = 256  # one block: 2 layers x K,V x 4 heads x 32 x fp32 x 256 tokens = 512 KiB, 4 per 2 MiB page
BLOCK_BYTES = 512 * 1024
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
    assert elastic_mean >= static_mean, (static_mean, elastic_mean, stats)
    # The plugin's own count agrees with the scheduler's.
    assert stats.steps == len(elastic) and stats.step_requests == sum(elastic)
