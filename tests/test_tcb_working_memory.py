"""An elastic engine's working memory does not grow with the budget it shares (kvcached_transformers.cb.window).

transformers' continuous batching sizes its attention mask (``max_batch_tokens x (capacity + max_batch_tokens)``) and
its read indices by the cache's capacity in tokens; on kvcached the capacity is address space, for an elastic model the
whole budget. These tests run one trace through a tiny random Llama on CPU at several capacities and look at what the
attention function is handed (the mask's and the read indices' storage, the keys): with the read window they stay the
same size when the capacity grows, no larger than a static engine's, and the tokens stay those of plain transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import wait_for  # noqa: E402

from kvcached_transformers import cb  # noqa: E402
from kvcached_transformers.cb.seams import UnsupportedTransformers, check_version  # noqa: E402
from kvcached_transformers.tiny import random_prompts, tiny_llama  # noqa: E402

try:
    check_version(transformers.__version__)
except UnsupportedTransformers:
    pytest.skip(f"transformers {transformers.__version__} is outside the continuous batching range",
                allow_module_level=True)

PAGE_TOKENS = 256
SHARE = 32  # blocks of PAGE_TOKENS: a static engine's cache, four times what the trace holds at once
MAX_BATCH_TOKENS = 256
NEW_TOKENS = 10


@dataclass
class Seen:
    """The largest attention inputs of a run, in bytes of their storage (a view's whole buffer counts)."""

    mask: int = 0
    read_index: int = 0
    keys: int = 0  # the keys attended over (the values are as many)
    reads: int = 0  # cached tokens one batch read (keys less queries: every request's past, summed)
    calls: int = 0


@contextmanager
def watched(implementation: str) -> Iterator[Seen]:
    """Every call of the attention function ``implementation`` records its inputs' sizes."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS[implementation]
    seen = Seen()

    def spy(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        seen.calls += 1
        if attention_mask is not None:
            seen.mask = max(seen.mask, attention_mask.untyped_storage().nbytes())
        indices = kwargs.get("read_index") or ()
        for index in indices:
            seen.read_index = max(seen.read_index, index.untyped_storage().nbytes())
        # The keys attended over: read from the cache before this call (transformers 5.2x), or inside it (5.19, whose
        # read indices name them, the new tokens' included).
        keys = max(key.shape[-2], *(index.numel() for index in indices))
        seen.keys = max(seen.keys, keys * key.shape[1] * key.shape[-1] * key.element_size())
        seen.reads = max(seen.reads, keys - query.shape[-2])
        return original(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = spy
    try:
        yield seen
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = original


def gen_config() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(num_blocks: int | None) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
                                    max_requests_per_batch=8)


def run(model: Any, prompts: list[list[int]], num_blocks: int | None) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=gen_config(), continuous_batching_config=cb_config(num_blocks))
    assert len(out) == len(prompts) and all(r.error is None for r in out.values())
    return [list(r.generated_tokens) for r in out.values()]


def on_kvcached(model: Any, prompts: list[list[int]], name: str, num_blocks: int,
                max_read_tokens: int | None = None) -> list[list[int]]:
    """The trace on kvcached with ``num_blocks`` of address space (``install``'s, as an elastic engine is given)."""
    with cb.install(model, name=name, num_blocks=num_blocks, max_read_tokens=max_read_tokens):
        return run(model, prompts, None)


@pytest.fixture(scope="module", params=["sdpa", "paged|eager"])
def model(request: pytest.FixtureRequest) -> Any:
    torch.set_num_threads(1)
    return tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512,
                      attn_implementation=request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, seed=5, min_len=6, max_len=48)


@pytest.fixture(scope="module")
def static(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], Seen]:
    """Plain transformers with a cache of one share: the static engine."""
    with watched(model.config._attn_implementation) as seen:
        tokens = run(model, prompts, SHARE)
    assert seen.calls and seen.read_index
    return tokens, seen


def test_attention_inputs_stay_the_same_size_when_the_budget_grows_8x(model: Any, prompts: list[list[int]],
                                                                    static: tuple[list[list[int]], Seen]) -> None:
    implementation = model.config._attn_implementation
    with watched(implementation) as small:
        tokens_small = on_kvcached(model, prompts, "tcb-one-share", SHARE)
    with watched(implementation) as large:
        tokens_large = on_kvcached(model, prompts, "tcb-eight-shares", 8 * SHARE)
    assert tokens_small == tokens_large == static[0]
    assert (large.mask, large.read_index, large.keys) == (small.mask, small.read_index, small.keys), (small, large)
    # The keys are what the batches read (the same on every path); the mask holds the batch's queries by the window.
    assert large.keys == static[1].keys
    assert large.mask <= MAX_BATCH_TOKENS * (2 * PAGE_TOKENS + MAX_BATCH_TOKENS) * 4  # fp32; a 2-sector window here


def test_an_elastic_engine_at_three_shares_gets_no_larger_attention_inputs_than_a_static_one(
        model: Any, prompts: list[list[int]], static: tuple[list[list[int]], Seen]) -> None:
    with watched(model.config._attn_implementation) as elastic:
        tokens = on_kvcached(model, prompts, "tcb-elastic", 3 * SHARE)
    assert tokens == static[0]
    assert elastic.mask <= static[1].mask and elastic.read_index <= static[1].read_index, (elastic, static[1])
    assert elastic.keys == static[1].keys


def test_the_window_follows_a_long_read_and_goes_back_when_idle(model: Any) -> None:
    """A prompt of 700 tokens is prefilled in chunks of 256 (the later chunks read the earlier ones), then decodes
    reading all of it: the window grows past its first sector for those reads, and back once the loop is idle."""
    long_prompt = random_prompts(1, seed=9, min_len=700, max_len=700)
    reference = run(model, long_prompt, SHARE)
    with cb.install(model, name="tcb-window", num_blocks=8 * SHARE) as handle:
        manager_cb = model.init_continuous_batching(generation_config=gen_config(),
                                                    continuous_batching_config=cb_config(None))
        manager_cb.start()
        try:
            wait_for(lambda: bool(handle.caches), what="the cache built")
            window = handle.caches[0].window
            assert window is not None and window.tokens == PAGE_TOKENS == window.step
            assert window.capacity == 8 * SHARE * PAGE_TOKENS
            (rid,) = manager_cb.add_requests(long_prompt, max_new_tokens=NEW_TOKENS)
            result = None
            while result is None or not result.is_finished():
                result = manager_cb.get_result(request_id=rid, timeout=120)
                assert result is not None, "the request did not finish"
            assert result.error is None and list(result.generated_tokens) == reference[0]
            # The second chunk reads 256 tokens (the first window holds them), the third 512: a window of 768 (1.25
            # times the read, in whole sectors), which the decodes' 700-709 fit.
            assert window.peak == 3 * PAGE_TOKENS and window.resizes >= 1
            wait_for(lambda: window.tokens == PAGE_TOKENS, what="the window back to one sector while idle")
            io = handle.loops[0].io
            assert io.read_index_storage.size(-1) == PAGE_TOKENS + MAX_BATCH_TOKENS
        finally:
            manager_cb.stop(block=True, timeout=30)


def test_max_read_tokens_bounds_what_one_batch_reads(model: Any, prompts: list[list[int]],
                                                     static: tuple[list[list[int]], Seen]) -> None:
    """Eight requests decoding together read up to about 400 cached tokens a batch; under a read budget of 128 the
    batches read at most that (the rest wait a step), and the tokens stay."""
    assert static[1].reads > 128
    with watched(model.config._attn_implementation) as capped:
        tokens = on_kvcached(model, prompts, "tcb-capped", 3 * SHARE, max_read_tokens=128)
    assert tokens == static[0]
    assert 0 < capped.reads <= 128 and capped.mask <= MAX_BATCH_TOKENS * (PAGE_TOKENS + MAX_BATCH_TOKENS) * 4, capped


def test_a_request_that_alone_reads_past_max_read_tokens_still_runs(model: Any, prompts: list[list[int]],
                                                                     static: tuple[list[list[int]], Seen]) -> None:
    long_prompt = random_prompts(1, seed=9, min_len=700, max_len=700)
    trace = [*prompts[:3], *long_prompt]
    reference = run(model, trace, SHARE)
    with watched(model.config._attn_implementation) as capped:
        tokens = on_kvcached(model, trace, "tcb-long", 3 * SHARE, max_read_tokens=64)
    assert tokens == reference
    assert 700 <= capped.reads <= 700 + NEW_TOKENS, capped  # the long one's read is the budget


def test_max_read_tokens_is_a_positive_whole_number(model: Any) -> None:
    for bad in (0, -5, 2.5, True, "64"):
        with pytest.raises(ValueError, match="max_read_tokens must be a positive integer"):
            cb.install(model, name="tcb-bad", max_read_tokens=bad)


def test_the_window_grows_at_once_and_shrinks_after_a_run_of_small_reads() -> None:
    from kvcached_transformers.cb.window import SHRINK_AFTER, ReadWindow

    window = ReadWindow(capacity=64 * PAGE_TOKENS, step=PAGE_TOKENS)
    assert window.tokens == PAGE_TOKENS and window.wanted(PAGE_TOKENS) is None
    assert window.wanted(1000) == 5 * PAGE_TOKENS  # 1.25 x 1000 in whole sectors
    assert window.wanted(1000, budget=1000) == 4 * PAGE_TOKENS  # never past the batch's budget (whole sectors)
    assert window.wanted(10**6) == 64 * PAGE_TOKENS  # nor the capacity
    window.tokens = 16 * PAGE_TOKENS
    for _ in range(SHRINK_AFTER - 1):
        assert window.wanted(100) is None  # a few small batches (decodes between prefills) keep it
    assert window.wanted(2000) is None  # one that needs it restarts the count
    for _ in range(SHRINK_AFTER - 1):
        assert window.wanted(100) is None
    assert window.wanted(100) == PAGE_TOKENS


def test_the_window_is_off_where_transformers_keeps_its_buffers() -> None:
    """CUDA graphs, compile and async batching hold the buffers (and pad reads to the capacity): transformers'
    sizing stays there."""
    from transformers.generation.configuration_utils import CompileConfig, ContinuousBatchingConfig

    from kvcached_transformers.cb.window import applies

    assert applies(ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=False))
    assert not applies(ContinuousBatchingConfig(use_cuda_graph=(True, False), use_async_batching=False))
    assert not applies(ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=True))
    assert not applies(ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=False,
                                                varlen_compile_config=CompileConfig()))
