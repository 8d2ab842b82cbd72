"""One KV budget per device (backends/ledger.py): claims of real processes' segments, counted per
backend and device; KVCACHED_DEVICE_BUDGET parsed once. (The CUDA backend under a budget runs on a
GPU: tests/test_cuda_backend.py.)"""

from __future__ import annotations

import subprocess
import threading

import pytest
from conftest import wait_for
from segment_holder import hold_segment

from kvcached_core.backends.ledger import CapacityLedger, lock_name
from kvcached_core.settings import ConfigError, DeviceBudget, Settings

MiB = 1 << 20


def _claimer(name: str, backend: str, device: int, claimed: int) -> subprocess.Popen:
    """A process whose segment (backend, device) claims ``claimed`` bytes, alive until its stdin closes."""
    return hold_segment(name, f"set_claimed({claimed})", backend=backend, device=device)


@pytest.fixture
def claimers():
    procs: list[subprocess.Popen] = []

    def start(*args) -> subprocess.Popen:
        procs.append(_claimer(*args))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_device_budget_counts_the_claims_of_its_own_device_only(claimers) -> None:
    claimers("a0", "cuda", 0, 40 * MiB)
    claimers("b0", "cuda", 0, 30 * MiB)
    claimers("c1", "cuda", 1, 50 * MiB)  # another device: its own budget
    claimers("h", "host", 0, 60 * MiB)  # the host budget: not device memory
    ledger = CapacityLedger(100 * MiB, backend="cuda", device=0)
    assert ledger._others() == 70 * MiB
    assert ledger.free_bytes() == 30 * MiB
    assert ledger.claim(30 * MiB) and ledger.claimed == 30 * MiB
    assert not ledger.claim(2 * MiB) and ledger.claimed == 30 * MiB  # refused: nothing changed
    other = CapacityLedger(100 * MiB, backend="cuda", device=1)
    assert other._others() == 50 * MiB and other.claim(50 * MiB) and not other.claim(1)
    host = CapacityLedger(100 * MiB, backend="host")
    assert host._others() == 60 * MiB


def test_a_claim_dies_with_its_process(claimers) -> None:
    proc = claimers("a0", "cuda", 0, 90 * MiB)
    ledger = CapacityLedger(100 * MiB, backend="cuda", device=0)
    assert not ledger.claim_total(20 * MiB)
    proc.kill()
    proc.wait()
    wait_for(lambda: ledger.claim_total(20 * MiB), what="the dead process's claim to stop counting")


def test_settle_records_what_is_held_and_the_lock_file_is_per_budget(shm_dir) -> None:
    seen: list[int] = []
    ledger = CapacityLedger(10 * MiB, backend="cuda", device=3)
    ledger.bind(seen.append)
    assert ledger.claim_total(8 * MiB) and seen[-1] == 8 * MiB
    ledger.settle(2 * MiB)
    assert ledger.claimed == seen[-1] == 2 * MiB
    assert lock_name("cuda", 3) != lock_name("cuda", 0) != lock_name("host", None)
    assert not list(shm_dir.iterdir())  # the lock file lives only while a claim is made


def test_a_release_while_another_thread_claims_is_not_lost(shm_dir, monkeypatch) -> None:
    """The refill thread claims (a scan of the directory between reading and setting ``claimed``) while alloc's
    thread unmaps and releases: the old ledger set the claim over the release, and held 1 MiB it had given back
    for good (seen as a test waiting for the ledger to equal what was mapped, on a 16-core machine)."""
    ledger = CapacityLedger(10 * MiB, backend="cuda", device=0)
    assert ledger.claim(4 * MiB)
    scanning, released = threading.Event(), threading.Event()
    real_others = ledger._others

    def slow_scan() -> int:
        scanning.set()
        released.wait(0.5)  # the release gets its chance here: with the ledger's own lock it waits instead
        return real_others()

    monkeypatch.setattr(ledger, "_others", slow_scan)
    claimer = threading.Thread(target=lambda: ledger.claim(2 * MiB))
    claimer.start()
    assert scanning.wait(5)
    releaser = threading.Thread(target=lambda: (ledger.release(MiB), released.set()))
    releaser.start()
    claimer.join(5)
    releaser.join(5)
    assert ledger.claimed == 5 * MiB  # 4 + 2 - 1


@pytest.mark.parametrize(("raw", "expected"), [
    ("60GiB", DeviceBudget(size_bytes=60 << 30)),
    ("80%", DeviceBudget(percent=80.0)),
    ("none", None),
    ("", None),
])
def test_device_budget_setting(raw: str, expected: DeviceBudget | None) -> None:
    assert Settings.from_env({"KVCACHED_DEVICE_BUDGET": raw}).device_budget == expected


@pytest.mark.parametrize("raw", ["abc", "0B", "-5G", "120%", "0%", "5"])
def test_bad_device_budget_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="KVCACHED_DEVICE_BUDGET"):
        Settings.from_env({"KVCACHED_DEVICE_BUDGET": raw}).device_budget  # noqa: B018


def test_a_percentage_budget_is_of_the_device() -> None:
    assert DeviceBudget(percent=25.0).of(80 << 30) == 20 << 30
    assert DeviceBudget(size_bytes=5 << 30).of(80 << 30) == 5 << 30
