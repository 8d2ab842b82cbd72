"""The transformers plugin: a real (tiny, random) Llama generating with its K/V in allocator blocks.

Tokens must match transformers' own DynamicCache exactly; blocks must go back as sequences end
(seen through the segment, as kvtop sees it); a tiny limit must raise KVCacheExhausted, or be
waited out when asked to.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import ROOT, child_env  # noqa: E402
from procs import Processes  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvcached_core as kc  # noqa: E402
from kvcached_core.engines import KVCacheExhausted  # noqa: E402
from kvcached_transformers import (  # noqa: E402
    GreedyEngine,
    PagedKVCache,
    cache_arg,
    generate,
    random_prompts,
    tiny_llama,
)

KiB = 1024
PAGE = 64 * KiB  # test model: 512 B per token per layer, 16-token blocks of 8 KiB, 8 blocks a page
BUDGETS = [5, 17, 1, 12, 9, 14]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and fast on a small shared machine
    yield tiny_llama(seed=0)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(len(BUDGETS), seed=1, min_len=3, max_len=40)


def alone(model, prompt: list[int], budget: int) -> list[int]:
    """Greedy continuation of one prompt, unbatched, with transformers' DynamicCache."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False,
                         **cache_arg(model, DynamicCache(config=model.config)), pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(model, prompts) -> list[list[int]]:
    return [alone(model, p, n) for p, n in zip(prompts, BUDGETS, strict=True)]


def padded(prompts: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[row, cols] = torch.tensor(p)
        mask[row, cols] = 1
    return ids, mask


def make_cache(model, name: str = "tiny", **kwargs) -> PagedKVCache:
    kwargs.setdefault("page_size", PAGE)
    kwargs.setdefault("max_tokens", 4096)
    return PagedKVCache.for_model(model, name=name, **kwargs)


# -- correctness ---------------------------------------------------------------------------------
def test_generate_with_paged_cache_matches_dynamic_cache(model, prompts):
    ids, mask = padded(prompts, "left")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         **cache_arg(model, DynamicCache(config=model.config)), pad_token_id=0, eos_token_id=None)
    with make_cache(model) as cache:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, **cache_arg(model, cache),
                             pad_token_id=0, eos_token_id=None)
        assert torch.equal(got, ref)
        # generate does not say when it is done: the rows keep their blocks until reset.
        width = ids.shape[1] + 15  # the last token is returned, never fed back
        per_row = math.ceil(width / cache.block_tokens)
        assert cache.blocks_held == per_row * len(prompts)
        assert kc.snapshot("tiny").blocks_used == cache.blocks_held
        cache.reset()
        assert kc.snapshot("tiny").blocks_used == 0
    assert "tiny" not in [m.name for m in kc.list_models()]


def test_beam_search_matches_dynamic_cache(model, prompts):
    """Beam reordering duplicates rows: the cache copies their blocks and frees dropped ones."""
    ids, mask = padded(prompts[:3], "left")
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None,
                  num_beams=3, num_return_sequences=2)
    ref = model.generate(ids, **cache_arg(model, DynamicCache(config=model.config)), **kwargs)
    with make_cache(model) as cache:
        got = model.generate(ids, **cache_arg(model, cache), **kwargs)
        assert torch.equal(got, ref)
        assert kc.snapshot("tiny").blocks_used == cache.blocks_held > 0


@pytest.mark.parametrize("max_batch", [None, 2])
def test_engine_matches_each_prompt_alone(model, prompts, expected, max_batch):
    """Ragged batching (requests join and leave mid-run) gives each prompt's own greedy tokens."""
    with make_cache(model) as cache:
        assert generate(model, cache, prompts, max_new_tokens=BUDGETS, max_batch=max_batch) == expected
        assert cache.blocks_held == 0


@pytest.mark.parametrize("side", ["left", "right"])
def test_engine_handles_either_padding_side(model, prompts, expected, side):
    ids, mask = padded(prompts, side)
    with make_cache(model) as cache:
        assert generate(model, cache, ids, attention_mask=mask, max_new_tokens=BUDGETS) == expected


# -- blocks come and go ---------------------------------------------------------------------------
def test_blocks_return_to_the_allocator_as_sequences_end(model, prompts):
    with make_cache(model) as cache:
        engine = GreedyEngine(model, cache)
        reqs = [engine.submit(p, n) for p, n in zip(prompts, BUDGETS, strict=True)]
        seen: list[int] = []
        while engine.busy:
            finished = engine.step()
            snap = kc.snapshot(cache.manager.name)  # the segment, as kvtop reads it
            # Each running request holds exactly the blocks its stored tokens need (prompt + fed outputs).
            want = sum(math.ceil((len(r.prompt) + len(r.output) - 1) / cache.block_tokens) for r in engine.running)
            assert snap.blocks_used == want == cache.blocks_held
            assert all(r.done for r in finished)
            seen.append(snap.blocks_used)
        assert all(r.done and len(r.output) == n for r, n in zip(reqs, BUDGETS, strict=True))
        assert max(seen) > 0 and seen[-1] == 0
        assert any(b < a for a, b in zip(seen, seen[1:], strict=False)), "blocks never went back mid-run"
        final = kc.snapshot(cache.manager.name)
        assert final.blocks_used == 0 and final.pages_inuse == 0 and final.engine == "transformers"


def test_crop_and_remove_free_blocks(model, prompts):
    with make_cache(model) as cache:
        cache.add_sequences(2)
        cache.begin_step([40, 20])
        for layer in range(len(cache.layers)):
            k = torch.randn(2, cache.kv_heads, 40, cache.head_dim)
            cache.update(k, k, layer)
        assert cache.blocks_held == 3 + 2
        cache.crop(-10)  # 30 and 10 tokens
        assert cache.seq_lengths == [30, 10] and cache.blocks_held == 2 + 1
        cache.remove_sequences([0])
        assert cache.seq_lengths == [10] and kc.snapshot("tiny").blocks_used == 1
        cache.close()
        assert cache.manager._closed
        assert "tiny" not in [m.name for m in kc.list_models()]


# -- exhaustion ----------------------------------------------------------------------------------
def test_tiny_limit_raises_a_clear_catchable_error(model, prompts):
    with make_cache(model) as cache:
        cache.manager.set_limit(cache.manager.bundle_bytes)  # one page: 8 blocks, 128 tokens in all
        engine = GreedyEngine(model, cache)
        for p in prompts[:3]:
            engine.submit(p, 200)
        with pytest.raises(KVCacheExhausted) as info:
            engine.run()
        err = info.value
        assert isinstance(err, RuntimeError)
        assert "'tiny'" in str(err) and "exhausted" in str(err) and "limit" in str(err)
        assert err.needed_blocks > err.available_blocks
        held = cache.blocks_held
        assert held <= 8 and kc.snapshot("tiny").blocks_used == held  # nothing half-allocated
        cache.reset()
        assert kc.snapshot("tiny").blocks_used == 0
        # The same through plain transformers generate: the error comes out of model.generate.
        ids, mask = padded(prompts[:3], "left")
        with pytest.raises(KVCacheExhausted):
            model.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False, **cache_arg(model, cache),
                           pad_token_id=0, eos_token_id=None)


def test_newcomers_wait_for_room_instead_of_failing(model, prompts, expected):
    """Under a limit, waiting requests are admitted as running ones finish and free blocks."""
    with make_cache(model) as cache:
        cache.manager.set_limit(cache.manager.bundle_bytes * 2)  # 16 blocks: not all six at once
        assert generate(model, cache, prompts, max_new_tokens=BUDGETS) == expected
        assert kc.snapshot("tiny").blocks_used == 0


def test_waits_for_blocks_until_a_controller_raises_the_limit(model):
    prompt = random_prompts(1, seed=3, min_len=120, max_len=120)[0]
    want = alone(model, prompt, 40)  # 159 tokens stored: 10 blocks, more than the one page allowed
    with make_cache(model, wait=60) as cache:
        cache.manager.set_limit(cache.manager.bundle_bytes)
        lifted: list[float] = []

        def lift() -> None:
            time.sleep(0.5)
            kc.request_limit("tiny", None, wait=30)  # through the segment, as kvctl does
            lifted.append(time.monotonic())

        thread = threading.Thread(target=lift)
        thread.start()
        try:
            got = generate(model, cache, [prompt], max_new_tokens=40)
            done_at = time.monotonic()
        finally:
            thread.join()
        assert got == [want]
        assert lifted and done_at >= lifted[0]  # it could only finish once the limit was gone
        assert cache.manager.limit_pages is None


# -- plugin discovery -----------------------------------------------------------------------------
def test_entry_point_lists_the_plugin_without_importing_it():
    code = (
        "import sys\n"
        "from kvcached_core.engines import installed_engines, load_engine\n"
        "names = [e.name for e in installed_engines()]\n"
        "assert 'transformers' in names, names\n"
        "assert 'torch' not in sys.modules and 'kvcached_transformers' not in sys.modules\n"
        "info = load_engine('transformers')\n"
        "assert info.name == 'transformers' and info.missing() == [], info\n"
        "assert 'torch' not in sys.modules, 'loading the plugin description imported torch'\n"
        "print('OK', info.cache)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "OK kvcached_transformers.cache:PagedKVCache" in out.stdout


def test_load_engine_unknown_name_says_what_exists():
    with pytest.raises(LookupError, match="transformers"):
        kc.engines.load_engine("no-such-engine")


# -- the example, as a user runs it ----------------------------------------------------------------
def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), *args], capture_output=True,
                          text=True, env=child_env(), timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 0), (signal.SIGTERM, 128 + signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm"])
def test_example_publishes_its_segment_and_holds_it(sig: int, code: int, procs: Processes):
    """Ctrl-C ends the hold early, cleanly; so does `kill` (SIGTERM): the segment goes with the example."""
    proc = procs.start(  # as from a terminal, whatever started the tests: Ctrl-C reaches it
        [sys.executable, str(ROOT / "examples" / "generate.py"), "--requests", "4", "--max-new-tokens", "8",
         "--prompt-len", "12", "--check", "--hold", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("holding the segment"):
            break
    text = "".join(lines)
    assert "identical to DynamicCache: yes" in text, text + proc.stderr.read() if proc.poll() is not None else text
    snap = kc.snapshot("tiny-llama")  # another process: read through the segment
    assert snap.status == "live" and snap.engine == "transformers" and snap.pid == proc.pid
    assert snap.blocks_used == 0 and snap.alloc_blocks > 0 and snap.free_blocks == snap.alloc_blocks
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == code
    assert "tiny-llama" not in [m.name for m in kc.list_models()]


def test_example_reports_exhaustion_in_one_line():
    out = run_example("--requests", "4", "--max-new-tokens", "64", "--prompt-len", "32", "--limit", "1MiB",
                      "--quiet")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "exhausted" in out.stderr and "Traceback" not in out.stderr


def test_example_rejects_bad_usage():
    out = run_example("--requests", "0")
    assert out.returncode == 2 and "--requests must be positive" in out.stderr


# -- GPU -----------------------------------------------------------------------------------------
def _cuda_ready() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        try:
            from cuda import cuda  # noqa: F401
        except ImportError:
            return "cuda-python is not installed"
    return None


@pytest.mark.gpu
def test_gpu_cache_over_cuda_backend_matches_dynamic_cache(prompts):
    reason = _cuda_ready()
    if reason:
        pytest.skip(reason)
    gpu_model = tiny_llama(seed=0, device="cuda")
    ids, mask = padded(prompts, "left")
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = gpu_model.generate(ids, **cache_arg(gpu_model, DynamicCache(config=gpu_model.config)), **kwargs)
    each_alone = [alone(gpu_model, p, n) for p, n in zip(prompts, BUDGETS, strict=True)]
    with PagedKVCache.for_model(gpu_model, name="tiny-gpu") as cache:
        assert cache.manager.backend.name == "cuda" and cache.pools[0][0].is_cuda
        assert torch.equal(gpu_model.generate(ids, **cache_arg(gpu_model, cache), **kwargs), ref)
        assert kc.snapshot("tiny-gpu").blocks_used == cache.blocks_held > 0
        cache.reset()
        assert generate(gpu_model, cache, prompts, max_new_tokens=BUDGETS, max_batch=3) == each_alone
        assert kc.snapshot("tiny-gpu").blocks_used == 0


# -- sleep and wake -------------------------------------------------------------------------------
def _asleep(m: kc.ModelSnapshot) -> bool:
    return m.sleep.state == "asleep" and m.mapped_bytes == 0 and m.blocks_used == 0


def test_engine_sleeps_after_its_running_requests_and_wakes_with_the_same_tokens(model, prompts, expected):
    from kvcached_core.control.sleep import request_sleep

    with make_cache(model) as cache:
        engine = GreedyEngine(model, cache)
        engine.enable_sleep()
        assert kc.snapshot("tiny").sleep.capable
        first = [engine.submit(p, n) for p, n in zip(prompts[:3], BUDGETS[:3], strict=True)]
        engine.step()
        engine.step()
        assert engine.running and kc.snapshot("tiny").mapped_bytes > 0
        ack = request_sleep("tiny", "sleep", wait=10)  # the poller serves it: the engine is between steps
        assert ack.status == "draining"
        later = [engine.submit(p, n) for p, n in zip(prompts[3:], BUDGETS[3:], strict=True)]
        while engine.running:
            engine.step()
        assert all(r.done for r in first) and not any(r.output for r in later)  # none admitted while draining
        m = kc.snapshot("tiny", with_pages=True)
        assert _asleep(m) and m.sleep.slept_bytes > 0 and not any(p & (1 << 31) for p in m.pages)
        assert engine.step() == [] and not engine.running  # asleep: the waiting requests wait
        request_sleep("tiny", "wake", wait=10, until_done=True)
        engine.run()
        assert [r.output for r in first + later] == expected


def test_engine_sleep_now_preempts_and_the_next_request_wakes_it(model, prompts, expected):
    from kvcached_core.control.sleep import request_sleep

    with make_cache(model) as cache:
        engine = GreedyEngine(model, cache)
        engine.enable_sleep()
        reqs = [engine.submit(p, n) for p, n in zip(prompts[:4], BUDGETS[:4], strict=True)]
        for _ in range(4):
            engine.step()
        assert len(engine.running) >= 2
        ack = request_sleep("tiny", "sleep_now", wait=10, until_done=True)
        assert ack.status == "asleep" and _asleep(kc.snapshot("tiny"))
        assert not engine.running and len(engine.waiting) == 4 - sum(r.done for r in reqs)
        more = [engine.submit(p, n) for p, n in zip(prompts[4:], BUDGETS[4:], strict=True)]  # wakes it
        assert kc.snapshot("tiny").sleep.state == "awake"
        engine.run()
        assert [r.output for r in reqs + more] == expected  # preempted requests recomputed, same tokens


def test_engine_sleeps_by_the_after_idle_policy(model, prompts, expected):
    from kvcached_core.control.sleep import request_sleep

    with make_cache(model) as cache:
        engine = GreedyEngine(model, cache)
        engine.enable_sleep()
        request_sleep("tiny", "policy", after_idle_s=0.3, wait=10)
        deadline = time.monotonic() + 30
        while not _asleep(kc.snapshot("tiny")):
            assert time.monotonic() < deadline, "the idle engine never slept"
            time.sleep(0.05)
        req = engine.submit(prompts[0], BUDGETS[0])
        engine.run()
        assert req.output == expected[0]
        engine.disable_sleep()
        assert not kc.snapshot("tiny").sleep.capable


# -- prefix cache and compaction -------------------------------------------------------------------
def test_prefix_cache_compacts_and_the_tokens_after_are_the_same(model, monkeypatch):
    """Finished requests leave their full blocks cached, scattered over many pages; kvctl compact (the
    poller runs the cache's handler) moves them into fewer pages, and prompts that hit the moved blocks
    give exactly the tokens they give without any cache."""
    from kvcached_core.control.compact import request_compact

    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "-1")
    prefixes = random_prompts(12, seed=7, min_len=33, max_len=40)  # two full 16-token blocks each
    first = list(prefixes)
    later = [p[:32] + [5 + i, 7, 11] for i, p in enumerate(prefixes)]  # the same 32 tokens, then new ones
    budgets = [3 + (i * 5) % 11 for i in range(len(prefixes))]
    expected = [alone(model, p, n) for p, n in zip(later, budgets, strict=True)]
    manager = kc.KVCacheManager("tiny-prefix", name="tiny-prefix", num_blocks=512, block_bytes=8 * KiB,
                                num_layers=4, page_size=PAGE, engine="transformers", block_tokens=16,
                                policy="best-fit")
    with PagedKVCache(manager, kv_heads=4, head_dim=32, dtype=torch.float32, owns_manager=True) as cache:
        engine = GreedyEngine(model, cache, prefix_cache=True)
        for p, n in zip(first, budgets, strict=True):
            engine.submit(p, n + 20)  # long decodes: each request's blocks spread over pages shared with others,
            engine.submit(p, n + 20)  # and a twin's, freed when it ends (its prefixes are cached already)
        engine.run()
        snap = kc.snapshot("tiny-prefix")
        cached = snap.blocks_cached
        assert snap.blocks_used == cached == len(cache.prefix) >= 24  # every full block of every request
        floor = -(-cached // 8)
        assert snap.pages_inuse > floor, "the cached blocks should be scattered for this test to mean anything"

        ack = request_compact("tiny-prefix", wait=10)
        after = kc.snapshot("tiny-prefix")
        assert after.pages_inuse == floor and after.blocks_cached == cached  # the packed floor, nothing dropped
        assert ack.bytes_returned == (snap.pages_inuse - floor) * snap.bundle_bytes > 0
        assert ack.bytes_copied > 0 and after.compaction.blocks_moved == ack.bytes_copied // (8 * KiB * 4 * 2)
        assert set(cache.prefix.hash_of) == set(manager.cache.blocks)  # the index follows the moves

        reqs = [engine.submit(p, n) for p, n in zip(later, budgets, strict=True)]
        engine.run()
        assert cache.prefix_hit_tokens == 12 * 32  # every later prompt reused its two moved blocks
        assert [r.output for r in reqs] == expected


def test_a_lowered_limit_evicts_cached_blocks_of_an_idle_engine_and_tokens_stay_right(model, monkeypatch):
    """An idle engine whose memory is all prefix cache: a limit below it (kvctl limit, served by the poller) has
    the cache's evict handler give up whole cached pages, as many as the limit needs, so it applies at once; the
    index forgets them, and later prompts (hitting what is left, or not) give the tokens they give uncached."""
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "-1")
    prefixes = random_prompts(10, seed=11, min_len=33, max_len=40)  # two full 16-token blocks each
    later = [p[:32] + [9 + i, 3] for i, p in enumerate(prefixes)]
    expected = [alone(model, p, 6) for p in later]
    manager = kc.KVCacheManager("tiny-limit", name="tiny-limit", num_blocks=512, block_bytes=8 * KiB,
                                num_layers=4, page_size=PAGE, engine="transformers", block_tokens=16)
    with PagedKVCache(manager, kv_heads=4, head_dim=32, dtype=torch.float32, owns_manager=True) as cache:
        engine = GreedyEngine(model, cache, max_batch=1, prefix_cache=True)  # one at a time fits one page
        for p in prefixes:
            engine.submit(p, 30)
        engine.run()
        before = kc.snapshot("tiny-limit")
        assert before.blocks_used == before.blocks_cached == len(cache.prefix) > 8  # idle: all of it is cache
        assert before.pages_inuse >= 3

        ack = kc.request_limit("tiny-limit", before.bundle_bytes, wait=10)
        after = kc.snapshot("tiny-limit")
        assert ack.status == "applied" and after.limit_status == "applied"
        assert after.pages_inuse == 1 and after.mapped_bytes == before.bundle_bytes
        assert 0 < after.blocks_cached <= 8  # one page's worth kept: only what the limit needed went
        assert set(cache.prefix.hash_of) == set(manager.cache.blocks)

        reqs = [engine.submit(p, 6) for p in later]
        engine.run()
        assert [r.output for r in reqs] == expected
        assert kc.snapshot("tiny-limit").limit_status == "applied"
