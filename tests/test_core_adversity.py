"""The allocator under adversity: handlers that fail, engines that misuse sleep, calls after close."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import configured, send

from kvcached_core import KVCacheManager, snapshot
from kvcached_core.allocator.compact import Move
from kvcached_core.segment import layout as L

MiB = 1024 * 1024
SMALL = dict(num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)


def test_sleep_and_wake_after_close_say_the_manager_is_closed() -> None:
    m = KVCacheManager("closed", **SMALL)  # type: ignore[arg-type]
    m.set_sleep_handler(lambda action: None)
    m.close()
    for call in (m.sleep.sleep, m.sleep.wake, m.sleep.ready, lambda: m.set_sleep_handler(None)):
        with pytest.raises(RuntimeError, match="'closed' is closed"):
            call()


# -- compaction: what a handler answers is checked before any accounting changes -------------------------------
def _accounting_holds(m: KVCacheManager, held: set[int]) -> None:
    """The page table, its counters and the published segment agree with the blocks the engine holds."""
    pages = m.pages
    assert {b for b in range(len(pages.block_used)) if pages.block_used[b]} == held
    assert pages.blocks_used == sum(pages.used) == len(held)
    assert all(m.pages.is_used(b) for b in m.cache.blocks)
    assert snapshot(m.name).blocks_used == len(held)


@pytest.mark.parametrize("mistake", ["frees its sources", "not a move", "not a list", "frees a destination"])
def test_a_compact_handlers_mistake_moves_nothing_and_keeps_the_accounting(
        mistake: str) -> None:
    from test_core_compact import MODEL, scattered

    no_pool = configured({"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0"})
    with KVCacheManager("compact", policy="best-fit", settings=no_pool, **MODEL) as m:  # type: ignore[arg-type]
        held = set(scattered(m))
        freed: set[int] = set()

        def handler(moves: list[Move]) -> list:
            if mistake == "frees its sources":
                sources = [s for s, _ in moves[:3]]
                m.free(sources)
                freed.update(sources)
                return moves
            if mistake == "frees a destination":
                m.free([moves[0][1]])
                return moves
            if mistake == "not a move":
                return [*moves[:2], (*moves[2], 0)]
            return None  # type: ignore[return-value]

        m.set_compact_handler(handler)
        with pytest.raises(ValueError, match="compact handler .*nothing moved"):
            m.compact()
        held -= freed
        _accounting_holds(m, held)
        m.free(sorted(held))  # every block the engine holds goes back, and nothing else
        _accounting_holds(m, set())


# -- the published state never lags the page table ---------------------------------------------------------------
# In the allocator's process: an engine thread allocates and frees (now and then it gives back every empty page,
# as a sleep does: release_all), and a sampler thread takes the allocator's lock and reads the segment through
# kvcached_core's reader. Every publish happens under that lock, so whenever the sampler holds it the segment says
# exactly what the page table holds; a step that lets go of the lock (a wait for the refill thread's batch in
# flight) must publish first. 2 MiB pages x 8 layers x K/V: a page bundle is 32 MiB of host memory to populate,
# so refill batches are in flight for milliseconds while controllers lower and raise the limit and trim.
LAG_ENGINE = """
import json, random, threading
from pathlib import Path
from kvcached_core.segment.reader import read_segment
stop = threading.Event()
path = Path(m.segment.path)
seen = {"samples": 0, "lagged": [], "asleep_mapped": 0}
def engine():
    rng = random.Random(7)
    held = []
    while not stop.is_set():
        got = m.alloc(rng.randint(1, 12))
        if got:
            held.append(got)
        if len(held) > 6 or (held and got is None):
            m.free(held.pop(0))
        if rng.random() < 0.05:
            m.release_all()
    for ids in held:
        m.free(ids)
def sampler():
    while not stop.is_set():
        with m.lock:
            p = m.pages
            mine = (p.pages_inuse, len(p.reserved), p.blocks_used, len(m.cache), p.mapped_pages * m.bundle_bytes)
            snap = read_segment(path)
        shown = (snap.pages_inuse, snap.pages_reserved, snap.blocks_used, snap.blocks_cached, snap.mapped_bytes)
        seen["samples"] += 1
        if shown != mine:
            seen["lagged"].append((shown, mine))
        if snap.sleep is not None and snap.sleep.state == "asleep" and snap.mapped_bytes:
            seen["asleep_mapped"] += 1
threads = [threading.Thread(target=engine), threading.Thread(target=sampler)]
for t in threads:
    t.start()
def report(out):
    stop.set()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps(seen))
"""
LAG_MODEL = dict(num_blocks=24 * 8, block_bytes=256 * 1024, num_layers=8, page_size=2 * MiB)


def test_the_segment_never_lags_the_page_table_under_controllers_and_churn(
        spawn_allocator, tmp_path: Path) -> None:
    import json
    import random
    import time

    from kvcached_core.control.requests import AckTimeout, request_limit, request_trim

    proc = spawn_allocator("lag", script=LAG_ENGINE, env={"KVCACHED_MIN_RESERVED_PAGES": "3",
                                                          "KVCACHED_MAX_RESERVED_PAGES": "6"}, **LAG_MODEL)
    rng = random.Random(11)
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline:
        try:
            if rng.random() < 0.25:
                request_trim("lag", wait=5)
            else:
                pages = rng.choice([None, 4, 8, 12, 24])
                request_limit("lag", None if pages is None else pages * 32 * MiB, wait=5)
        except AckTimeout:  # a loaded host: the next request goes on
            pass
    out = tmp_path / "seen.json"
    send(proc, f"report({str(out)!r})")
    seen = json.loads(out.read_text())
    assert seen["samples"] > 100
    assert seen["lagged"] == [], f"{len(seen['lagged'])} of {seen['samples']} reads lagged: {seen['lagged'][:3]}"
    assert seen["asleep_mapped"] == 0


# -- asleep means nothing mapped ------------------------------------------------------------------------------------
def test_ready_while_blocks_are_held_refuses_and_the_model_stays_draining() -> None:
    with KVCacheManager("nap", **SMALL) as m:  # type: ignore[arg-type]
        m.set_sleep_handler(lambda action: None)
        active, cached = m.alloc(6), m.alloc(2)
        assert active and cached
        m.mark_cached(cached)
        m.sleep.sleep()
        with pytest.raises(RuntimeError, match="holds 8 blocks \\(2 of them cached\\).*stays draining"):
            m.sleep.ready()
        m.free(active)
        with pytest.raises(RuntimeError, match="holds 2 blocks"):
            m.sleep.ready()
        shown = snapshot("nap")
        assert shown.sleep is not None and shown.sleep.state == "draining" and shown.blocks_used == 2
        m.free(cached)
        assert m.sleep.ready() > 0
        shown = snapshot("nap")
        assert shown.sleep is not None and shown.sleep.state == "asleep" and shown.mapped_bytes == 0


def test_an_alloc_while_asleep_wakes_the_model_and_its_handler_hears_it() -> None:
    from conftest import wait_for

    with KVCacheManager("nap", **SMALL) as m:  # type: ignore[arg-type]
        heard: list[str] = []
        m.set_sleep_handler(heard.append)
        m.sleep.sleep()
        m.sleep.ready()
        assert snapshot("nap").sleep.state == "asleep"  # type: ignore[union-attr]
        ids = m.alloc(4)  # the engine's next request, before it called wake()
        assert ids is not None and len(ids) == 4
        shown = snapshot("nap")
        assert shown.sleep is not None and shown.sleep.state == "awake" and shown.mapped_bytes > 0
        assert m.sleep.state == L.SLEEP_AWAKE
        wait_for(lambda: heard == ["sleep", "wake"], what="the handler to hear wake from the poller")
        m.sleep.wake()  # the engine's own wake after it: nothing more to tell
        assert heard == ["sleep", "wake"]
        m.free(ids)
        # try_to_reserve maps as an alloc does: it wakes a sleeping model too
        m.sleep.sleep()
        m.sleep.ready()
        assert m.try_to_reserve(1) and snapshot("nap").sleep.state == "awake"  # type: ignore[union-attr]


# -- the process's poller survives any handler ----------------------------------------------------------------------
# Two allocators in one process, one poller thread. "a" holds a cached block alone on its second page, so a compaction
# has a move to hand its compact handler, which raises SystemExit; its evict handler raises KeyboardInterrupt.
TWO_IN_ONE = """
import sys
from kvcached_core.allocator.compact import plan
b = KVCacheManager("b", name="b", num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
ids = [m.alloc(1)[0] for _ in range(8)]
m.free([ids[0], *ids[5:]])
m.mark_cached(ids[2:5])
assert plan(m.pages, m.cache)
def leave(moves):
    raise SystemExit(3)
def interrupt():
    raise KeyboardInterrupt
m.set_compact_handler(leave)
m.set_evict_handler(interrupt)
"""


def test_a_handler_that_raises_systemexit_does_not_stop_the_poller(spawn_allocator) -> None:
    from conftest import kvctl, wait_for

    from kvcached_core.control.requests import request_limit, request_trim

    spawn_allocator("a", script=TWO_IN_ONE)
    failed = kvctl("compact", "a", "--wait", "5")
    assert failed.exit_code == 1 and "compaction failed" in failed.stderr and failed.stderr.count("\n") == 1
    assert snapshot("a").blocks_used == 4  # nothing moved
    # A limit the cached blocks hold up: the poller asks the evict handler, which raises KeyboardInterrupt.
    assert request_limit("a", 256 * 1024 * 2 * 2, wait=5).status == "deferred"
    assert request_trim("b", wait=5).status == "trimmed"
    assert request_trim("a", wait=5).status == "trimmed"
    beat = snapshot("b").heartbeat_ns
    wait_for(lambda: snapshot("b").heartbeat_ns > beat, what="b's next heartbeat")
    assert not snapshot("b").late and not snapshot("a").late


def test_the_poller_serves_the_others_whatever_one_tick_raises() -> None:
    import threading

    from conftest import wait_for

    from kvcached_core.allocator import poller

    class Served:
        def __init__(self) -> None:
            self.ticks = 0
            self._closed = False

    calm, wild = Served(), Served()
    errors = [SystemExit(1), KeyboardInterrupt(), ValueError("not closed: a bug"), OSError(5, "EIO"), GeneratorExit()]

    def tick(served: Served, raises: list[BaseException]) -> bool:
        served.ticks += 1
        if raises:
            raise raises.pop(0)
        return True

    entries = [poller.register(calm, 0, tick, []), poller.register(wild, 0, tick, errors)]
    try:
        wait_for(lambda: not errors and wild.ticks > 6 and calm.ticks > 6, what="both served through every error")
        assert all(t.name != "kvc-poller" or t.is_alive() for t in threading.enumerate())
    finally:
        for entry in entries:
            poller.unregister(entry)


# -- a sleep handler that raises ------------------------------------------------------------------------------------
FAILING_SLEEP = """
fail = [SystemExit(2)]
heard = []
def handler(action):
    heard.append(action)
    if fail and action.startswith("sleep"):
        raise fail.pop(0)
    if action.startswith("sleep"):
        m.free(held)
        held.clear()
        m.sleep.ready()
held = m.alloc(4)
m.set_sleep_handler(handler)
"""


def test_a_sleep_handler_that_raises_refuses_the_request_and_the_model_stays_awake(spawn_allocator) -> None:
    from conftest import kvctl, wait_for

    from kvcached_core.control.requests import ControlError
    from kvcached_core.control.sleep import request_sleep

    proc = spawn_allocator("eng", script=FAILING_SLEEP)
    refused = kvctl("sleep", "eng", "--wait", "--timeout", "30")
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1
    assert "eng refused to sleep: its engine's sleep handler failed" in refused.stderr and "stays awake" in refused.stderr
    shown = snapshot("eng")
    assert shown.sleep is not None and shown.sleep.state == "awake" and shown.blocks_used == 4
    send(proc, "assert m.sleep.state == 0, m.sleep.state")  # the allocator is awake too: it refills its pool
    send(proc, "fail.append(KeyboardInterrupt())")
    with pytest.raises(ControlError, match="refused to sleep now"):
        request_sleep("eng", "sleep_now", wait=30)
    woke = kvctl("wake", "eng", "--wait", "--timeout", "30")
    assert woke.exit_code == 0, woke.stderr
    assert request_sleep("eng", "sleep", wait=30, until_done=True).status == "asleep"  # the next one is served
    wait_for(lambda: snapshot("eng").mapped_bytes == 0)
    assert request_sleep("eng", "wake", wait=30, until_done=True).status == "awake"
