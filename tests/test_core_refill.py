"""The refill thread: batches where the backend asks for them, and wakes again after lingering."""

from __future__ import annotations

import os
import threading
import time

import pytest
from conftest import configured, wait_for

from kvcached_core import KVCacheManager
from kvcached_core.allocator import refill as refill_mod
from kvcached_core.settings import Settings

MODEL = dict(num_blocks=64 * 16, block_bytes=16 * 1024, num_layers=1, page_size=256 * 1024)  # 16 blocks a page


ENV = {"KVCACHED_IDLE_RETURN_S": "-1", "KVCACHED_MIN_RESERVED_PAGES": "2", "KVCACHED_MAX_RESERVED_PAGES": "6"}


def cfg() -> Settings:
    return configured(ENV)


def settled_pool(m: KVCacheManager) -> int:
    wait_for(lambda: m.pages.inflight == 0 and len(m.pages.reserved) >= m.min_reserved, what="the pool to refill")
    time.sleep(0.05)  # nothing more arrives
    return len(m.pages.reserved)


@pytest.mark.parametrize(("batch", "expected"), [(1, 2), (3, 3), (9, 6)])
def test_a_short_pool_refills_in_the_backends_batch_up_to_the_maximum(batch: int, expected: int) -> None:
    with KVCacheManager("batch", settings=cfg(), **MODEL) as m:
        m.backend.refill_batch = batch
        assert m.alloc(16) is not None  # maps one page on the spot; the pool (empty) is short
        assert settled_pool(m) == expected


def test_a_refill_after_the_thread_went_back_to_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refill_mod, "REFILL_LINGER_S", 0.02)
    with KVCacheManager("linger", settings=cfg(), **MODEL) as m:
        m.alloc(16)
        assert settled_pool(m) == 2
        wait_for(lambda: not m._refill_polling, what="the refill thread to stop polling")
        assert m.alloc(32) is not None  # the two pool pages go: the thread must be woken
        assert settled_pool(m) == 2 and m.pages.pages_inuse == 3


def test_without_lingering_the_refill_thread_sleeps_until_an_alloc_wakes_it() -> None:
    with KVCacheManager("nolinger", refill_linger_s=0.0, settings=cfg(), **MODEL) as m:
        for _ in range(3):
            assert m.alloc(32) is not None  # takes the pool's pages (or maps on the spot): the pool is short
            assert settled_pool(m) == 2
            wait_for(lambda: not m._refill_polling, what="the refill thread to sleep")  # never polls after a refill


@pytest.mark.parametrize("bad", [-1, "0.1", None.__class__])
def test_a_bad_refill_linger_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="refill_linger_s"):
        KVCacheManager("badlinger", refill_linger_s=bad, settings=cfg(), **MODEL)  # type: ignore[arg-type]


def test_the_refill_thread_runs_nicer_than_the_engine() -> None:
    """Mapping ahead yields the CPU to the engine's threads (Linux: a nice value per thread)."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with KVCacheManager("nice", settings=cfg(), **MODEL) as m:
        m.alloc(16)
        (refill,) = [t for t in threading.enumerate() if t.name == "kvc-refill-nice"]
        assert refill.native_id is not None
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, refill.native_id) != own, what="the thread to lower itself")
        assert os.getpriority(os.PRIO_PROCESS, refill.native_id) == min(19, own + refill_mod.REFILL_NICE)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's own is untouched
        assert settled_pool(m) >= 2  # and it still refills
