"""transformers' own continuous batching on kvcached (kvcached_transformers.cb): a tiny random Llama on CPU.

Every test compares greedy tokens with plain transformers (continuous batching without kvcached, and
``generate``) and drives the allocator the way a user does: ``kvctl`` as a subprocess or through its CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT, kvctl, send, wait_for  # noqa: E402

import kvcached_core as kc  # noqa: E402
from kvcached_transformers import cb  # noqa: E402
from kvcached_transformers.cb.seams import UnsupportedTransformers, check_version  # noqa: E402
from kvcached_transformers.tiny import random_prompts, tiny_llama  # noqa: E402

try:
    check_version(transformers.__version__)
    SUPPORTED_HERE = True
except UnsupportedTransformers:
    SUPPORTED_HERE = False
needs_cb = pytest.mark.skipif(not SUPPORTED_HERE, reason=f"transformers {transformers.__version__} is outside "
                              f"the continuous batching range")

PAGE_TOKENS = 256  # one transformers block: 2 layers x K,V x 4 heads x 32 x fp32 x 256 = 512 KiB, 4 per 2 MiB page
NUM_BLOCKS = 16
NEW_TOKENS = 10
# The venv's kvctl; where there is none (the GPU machine runs the package from the tree), kvctl's module.
KVCTL = [str(ROOT / ".venv" / "bin" / "kvctl")] if (ROOT / ".venv" / "bin" / "kvctl").exists() else [
    sys.executable, "-m", "kvtop.cli"]


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(8, seed=5, min_len=6, max_len=48)


def gen_config() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(**overrides: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    kwargs = {"page_size": PAGE_TOKENS, "num_blocks": NUM_BLOCKS, "max_batch_tokens": 256,
              "max_requests_per_batch": 8, **overrides}
    return ContinuousBatchingConfig(**kwargs)


def run(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt, in order, through ``model.generate_batch``."""
    out = model.generate_batch(prompts, generation_config=gen_config(), continuous_batching_config=cb_config())
    assert len(out) == len(prompts) and all(r.error is None for r in out.values())
    return [list(r.generated_tokens) for r in out.values()]


@pytest.fixture(scope="module")
def plain(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Plain transformers continuous batching, no kvcached."""
    assert cb.installed(model) is None
    return run(model, prompts)


@contextmanager
def installed(model: Any, name: str) -> Iterator[cb.CBInstall]:
    handle = cb.install(model, name=name)
    try:
        yield handle
    finally:
        handle.close()
    assert cb.installed(model) is None


@contextmanager
def sampled(read: Callable[[], int]) -> Iterator[list[int]]:
    """The highest value ``read()`` gave while the block ran, sampled every millisecond."""
    peak = [0]
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], read())
            time.sleep(0.001)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


def served(manager_cb: Any, batch: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of ``batch`` through a running continuous batching manager, in order."""
    ids = manager_cb.add_requests(batch, max_new_tokens=NEW_TOKENS)
    results: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    while len(results) < len(ids):
        assert time.monotonic() < deadline, "requests did not finish"
        got = manager_cb.get_result(timeout=1)
        if got is not None and got.is_finished():
            assert got.error is None, got.error
            results[got.request_id] = list(got.generated_tokens)
    return [results[i] for i in ids]


def test_version_outside_the_range_is_refused_in_one_line() -> None:
    for found in ("5.17.0", "5.26.0", "6.0.0"):
        with pytest.raises(UnsupportedTransformers) as info:
            check_version(found)
        assert "\n" not in str(info.value) and found in str(info.value) and ">=5.19,<5.26" in str(info.value)
    check_version("5.19.0")
    check_version("5.25.0.dev0")


def test_install_refuses_this_transformers_when_outside_the_range(model: Any) -> None:
    if SUPPORTED_HERE:
        pytest.skip("this transformers is supported")
    with pytest.raises(UnsupportedTransformers):
        cb.install(model, name="refused")
    assert cb.installed(model) is None


@needs_cb
def test_tokens_equal_plain_continuous_batching_and_generate(model: Any, prompts: list[list[int]],
                                                             plain: list[list[int]]) -> None:
    with installed(model, "cb-tokens") as handle:
        with sampled(lambda: handle.manager.used_blocks if handle.manager else 0) as peak:
            ours = run(model, prompts)
        manager = handle.manager
        assert manager is not None and manager.engine == "transformers"
        # One kvcached block per transformers sector (one block of 256 tokens here), two padding sectors more.
        assert manager.num_blocks == NUM_BLOCKS + 2 and manager.block_bytes == 512 * 1024
        assert manager.alloc_blocks >= len(prompts) + 2 and peak[0] >= 4
        assert manager.used_blocks == 0  # the stop gave every sector back, the padding ones too
    assert ours == plain
    for prompt, tokens in zip(prompts[:3], ours, strict=False):
        ref = model.generate(torch.tensor([prompt]), generation_config=gen_config())
        assert ref[0, len(prompt):].tolist() == tokens


@needs_cb
def test_kvctl_lists_the_model(model: Any, prompts: list[list[int]]) -> None:
    with installed(model, "cb-listed") as handle:
        run(model, prompts[:2])
        env = dict(os.environ)  # KVCACHED_SHM_DIR: this test's directory (conftest)
        out = subprocess.run([*KVCTL, "list", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = {row["name"]: row for row in json.loads(out.stdout)}
        row = rows["cb-listed"]
        assert row["engine"] == "transformers" and row["model"] == "tiny-llama"
        assert row["blocks_per_page"] == 4 and row["page_size"] == 2 << 20 and row["pages_total"] == 5
        assert row["traffic"]["finished"] == 2
        assert handle.segment == "cb-listed"
    out = subprocess.run([*KVCTL, "list", "--json"], env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert "cb-listed" not in {row["name"] for row in json.loads(out.stdout)}  # close removed the segment


@needs_cb
def test_a_limit_below_use_queues_requests_and_tokens_stay(model: Any, prompts: list[list[int]],
                                                           plain: list[list[int]]) -> None:
    with installed(model, "cb-limit") as handle:
        with sampled(lambda: handle.manager.used_blocks if handle.manager else 0) as free_peak:
            assert run(model, prompts) == plain
        manager = handle.manager
        assert manager is not None and free_peak[0] >= 6  # 8 requests of one block each, 2 padding blocks
        result = kvctl("limit", "cb-limit", "2MiB")  # one page: 2 padding blocks and 2 requests
        assert result.exit_code == 0, result.output
        with sampled(manager.backend_mapped_bytes) as mapped, sampled(lambda: manager.used_blocks) as used:
            assert run(model, prompts) == plain
        assert mapped[0] <= 2 << 20 and used[0] <= 4 < free_peak[0], (mapped[0], used[0])
        assert kc.snapshot("cb-limit").traffic.finished == 2 * len(prompts)  # counted across both batches


@needs_cb
def test_trim_returns_the_reserved_pages(model: Any, prompts: list[list[int]]) -> None:
    with installed(model, "cb-trim") as handle:
        run(model, prompts)
        manager = handle.manager
        assert manager is not None and manager.used_blocks == 0
        before = manager.backend_mapped_bytes()
        assert before > 0  # emptied pages stay mapped as the reserve pool
        result = kvctl("trim", "cb-trim")
        assert result.exit_code == 0, result.output
        assert manager.backend_mapped_bytes() == 0 < before
        assert kc.snapshot("cb-trim").mapped_bytes == 0


@needs_cb
def test_sleep_and_wake_keep_the_tokens(model: Any, prompts: list[list[int]], plain: list[list[int]]) -> None:
    with installed(model, "cb-sleep") as handle:
        manager_cb = model.init_continuous_batching(generation_config=gen_config(),
                                                    continuous_batching_config=cb_config())
        manager_cb.start()
        try:
            def serve(batch: list[list[int]]) -> list[list[int]]:
                return served(manager_cb, batch)

            assert serve(prompts) == plain
            assert kc.snapshot("cb-sleep").sleep.capable
            result = kvctl("sleep", "cb-sleep", "--wait", "--timeout", "30")
            assert result.exit_code == 0, result.output
            m = kc.snapshot("cb-sleep")
            assert m.sleep.state == "asleep" and m.mapped_bytes == 0 and m.sleep.slept_bytes > 0
            assert handle.manager is not None and handle.manager.used_blocks == 0
            result = kvctl("wake", "cb-sleep")
            assert result.exit_code == 0, result.output
            wait_for(lambda: kc.snapshot("cb-sleep").sleep.state == "awake", what="awake")
            assert serve(prompts) == plain
            # Asleep again; the next requests wake it by themselves.
            assert kvctl("sleep", "cb-sleep", "--wait", "--timeout", "30").exit_code == 0
            assert kc.snapshot("cb-sleep").sleep.state == "asleep"
            assert serve(prompts[:4]) == plain[:4]
            assert kc.snapshot("cb-sleep").sleep.state == "awake"
        finally:
            manager_cb.stop(block=True, timeout=30)
        assert not kc.snapshot("cb-sleep").sleep.capable  # the loop stopped: nobody serves a sleep


@needs_cb
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tokens_equal_plain_continuous_batching_on_the_cuda_backend(prompts: list[list[int]]) -> None:
    gpu = tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512, device="cuda")
    reference = run(gpu, prompts)
    with installed(gpu, "cb-cuda") as handle:
        assert run(gpu, prompts) == reference
        manager = handle.manager
        assert manager is not None and manager.backend.name == "cuda" and manager.used_blocks == 0
        assert manager.alloc_blocks >= len(prompts) + 2


@needs_cb
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_working_memory_is_registered_with_the_allocator_on_the_gpu(prompts: list[list[int]]) -> None:
    """torch's peak beside the weights (the attention window, activations, logits) reaches the segment, where the
    device's budget keeps what the engine does not hold yet free."""
    from kvcached_core.segment import layout

    gpu = tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512, device="cuda")
    with installed(gpu, "cb-working") as handle:
        assert handle.working_memory is None  # nothing measured before the first batch
        run(gpu, prompts)
        manager = handle.manager
        assert manager is not None and handle.working_memory is not None
        peak, now = handle.working_memory
        assert 0 <= now <= peak and peak > 0
        raw = manager.segment.path.read_bytes()
        registered = [layout.U64.unpack_from(raw, off)[0] for off in (layout.WORKING_PEAK_OFF, layout.WORKING_NOW_OFF)]
        # Registered at every scheduling pass: at least the first batch's, at most what torch measured since.
        assert 0 < registered[0] <= peak and registered[1] <= registered[0], (registered, peak, now)


@needs_cb
def test_a_request_the_limit_cannot_hold_waits_until_the_limit_is_lifted(model: Any) -> None:
    """Three blocks for one request, the padding blocks beside it, under a one-page limit (4 blocks): plain
    transformers would fail every request ("No requests can be scheduled and no requests can be offloaded");
    here it waits, and runs with the same tokens once kvctl lifts the limit."""
    long_prompt = random_prompts(1, seed=9, min_len=600, max_len=600)
    expected = run(model, long_prompt)
    with installed(model, "cb-wait") as handle:
        assert run(model, long_prompt[:1]) == expected  # the allocator exists; its pages are free again
        assert kvctl("limit", "cb-wait", "2MiB").exit_code == 0
        manager_cb = model.init_continuous_batching(generation_config=gen_config(),
                                                    continuous_batching_config=cb_config())
        manager_cb.start()
        try:
            rid = manager_cb.add_request(long_prompt[0], max_new_tokens=NEW_TOKENS)
            wait_for(lambda: (t := kc.snapshot("cb-wait").traffic) is not None and t.waiting + t.running == 1,
                     what="the request to be seen")
            time.sleep(1.0)  # ten turns of the idle loop
            assert manager_cb.is_running() and manager_cb.get_result(timeout=0.1) is None
            assert handle.manager is not None and handle.manager.used_blocks <= 4
            assert kvctl("limit", "cb-wait", "none").exit_code == 0
            got = None
            deadline = time.monotonic() + 60
            while got is None or not got.is_finished():
                assert time.monotonic() < deadline, "the request never ran"
                got = manager_cb.get_result(rid, timeout=1)
            assert got.error is None and [list(got.generated_tokens)] == expected
        finally:
            manager_cb.stop(block=True, timeout=30)


@needs_cb
def test_prefix_blocks_are_cached_blocks_a_lowered_limit_evicts_while_idle(model: Any) -> None:
    """transformers keeps each finished request's whole blocks for prefix sharing: kvcached shows them cached, and
    a limit below them (kvctl, the engine idle) evicts whole cached pages through the loop; transformers forgets
    them, so the same prompts afterwards give the same tokens (a hit on an evicted block would read lost KV)."""
    prompts = random_prompts(4, seed=12, min_len=600, max_len=600)  # 2 whole blocks each, a third partly
    expected = run(model, prompts)
    with installed(model, "cb-prefix") as handle:
        manager_cb = model.init_continuous_batching(generation_config=gen_config(),
                                                    continuous_batching_config=cb_config())
        manager_cb.start()
        try:
            assert served(manager_cb, prompts) == expected
            m = kc.snapshot("cb-prefix")
            assert m.blocks_cached == 8 and m.blocks_used == 10 and m.mapped_bytes >= 3 * (2 << 20)
            result = kvctl("limit", "cb-prefix", "2MiB", "--wait-applied", "30")
            assert result.exit_code == 0, result.output
            m = kc.snapshot("cb-prefix")
            assert m.mapped_bytes <= 2 << 20 and m.blocks_cached <= 2 and m.limit_status == "applied"
            manager = handle.manager
            assert manager is not None and manager.evicted_blocks >= 6
            assert kvctl("limit", "cb-prefix", "none").exit_code == 0
            assert served(manager_cb, prompts) == expected
            assert served(manager_cb, prompts) == expected  # now with prefix hits on every whole block
        finally:
            manager_cb.stop(block=True, timeout=30)


@needs_cb
def test_install_all_puts_a_model_loaded_elsewhere_on_kvcached(prompts: list[list[int]],
                                                               plain: list[list[int]]) -> None:
    """What ``transformers serve`` needs: a model the plug-in never saw, its manager started by other code."""
    other = tiny_llama(seed=3, layers=2, hidden_size=256, heads=8, kv_heads=4, intermediate_size=512)
    other.config.name_or_path = "served-model"
    cb.install_all()
    try:
        assert run(other, prompts) == plain  # the same weights as the module's model
        handle = cb.installed(other)
        assert handle is not None and handle.segment == "served-model"
        assert kc.snapshot("served-model").traffic.finished == len(prompts)
        handle.close()
    finally:
        cb.uninstall_all()
    assert run(other, prompts[:2]) == plain[:2] and cb.installed(other) is None


# An idle engine elsewhere with 1 page of active blocks and 4 pages of cached ones (2 MiB pages, like ours);
# its evict handler gives cached pages when asked.
DONOR = """
active = m.alloc(4)
cached = m.alloc(16)
assert active is not None and cached is not None
m.mark_cached(cached)
m.set_evict_handler(lambda: m.evict_for_limit())
"""


@needs_cb
def test_memory_another_model_holds_is_reclaimed_for_the_batch(model: Any, prompts: list[list[int]],
                                                               plain: list[list[int]], spawn_allocator: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One 10 MiB budget, all of it mapped by another process's idle model: the cache's padding sectors and the
    batch's sectors (3 pages) come from that model's cached pages, through kvcached's reclaim."""
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "10MiB")
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    donor = spawn_allocator("donor", script=DONOR, num_blocks=64, block_bytes=512 * 1024, num_layers=1,
                            num_kv_buffers=1, page_size=2 << 20)
    wait_for(lambda: kc.snapshot("donor").mapped_bytes == 10 << 20, what="the donor to fill the budget")
    with installed(model, "cb-asker"):
        assert run(model, prompts) == plain
        donor_now, ours = kc.snapshot("donor"), kc.snapshot("cb-asker")
        assert donor_now.pressure.gave_total >= 6 << 20 and donor_now.pressure.given_cached > 0
        assert ours.pressure.took_total >= 6 << 20 and ours.traffic.finished == len(prompts)
        assert donor_now.blocks_used - donor_now.blocks_cached == 4  # its active blocks stay
    send(donor, "assert all(m.pages.is_used(b) for b in active)")


@needs_cb
def test_an_idle_models_prefix_blocks_are_reclaimed_by_another(model: Any, spawn_allocator: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The other way round: this model idles with 8 cached blocks (3 pages with its padding) under an 8 MiB budget;
    another process's model asks for 3 pages; the loop evicts whole cached pages for the reclaim, transformers
    forgets them, and the same prompts give the same tokens afterwards."""
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "8MiB")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    prompts = random_prompts(4, seed=12, min_len=600, max_len=600)
    expected = run(model, prompts)
    with installed(model, "cb-donor"):
        manager_cb = model.init_continuous_batching(generation_config=gen_config(),
                                                    continuous_batching_config=cb_config())
        manager_cb.start()
        try:
            assert served(manager_cb, prompts) == expected
            assert kc.snapshot("cb-donor").blocks_cached == 8
            asker = spawn_allocator("asker", num_blocks=64, block_bytes=512 * 1024, num_layers=1, num_kv_buffers=1,
                                    page_size=2 << 20)
            send(asker, "import time; deadline = time.monotonic() + 30")
            send(asker, "while (got := m.alloc(12)) is None and time.monotonic() < deadline: time.sleep(0.01)")
            send(asker, "assert got is not None")
            ours = kc.snapshot("cb-donor")
            assert ours.pressure.gave_total >= 2 << 20 and ours.pressure.given_cached > 0
            assert ours.blocks_cached < 8 and kc.snapshot("asker").pressure.took_total > 0
            send(asker, "m.free(got)")
            send(asker, "m.trim()")
            assert served(manager_cb, prompts) == expected
        finally:
            manager_cb.stop(block=True, timeout=30)


@needs_cb
def test_the_refill_thread_beside_the_engine_looks_only_when_an_alloc_asks(model: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """While the engine serves, its allocator's refill thread sleeps until an alloc wakes it: each unasked look takes
    the GIL from the engine's scheduling thread. Lingering after an alloc, it looked every 0.5 ms (thousands of looks
    over this run, against a few dozen allocs)."""
    from kvcached_core.allocator import refill

    looks = [0]
    real_step = refill.step

    def counted(m: Any, linger_until: float) -> float | None:
        looks[0] += 1
        return real_step(m, linger_until)

    monkeypatch.setattr(refill, "step", counted)
    batch = random_prompts(12, seed=8, min_len=200, max_len=600)
    with installed(model, "cb-quiet") as handle:
        config = gen_config()
        config.max_new_tokens = 64
        out = model.generate_batch(batch, generation_config=config, continuous_batching_config=cb_config(num_blocks=48))
        assert all(r.error is None for r in out.values())
        manager = handle.manager
        assert manager is not None
        allocs = manager.alloc_count
    assert allocs > 0
    assert looks[0] <= 2 * allocs + 10, f"{looks[0]} looks of the refill thread for {allocs} allocs"
