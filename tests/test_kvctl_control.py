"""kvctl limit / trim round trips: a real allocator in a child process acknowledges each request."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import freeze, kvctl, send, wait_for

from kvcached_core import snapshot
from kvcached_core.segment import layout as L

MiB = 1024 * 1024
BUNDLE = MiB  # the spawn_allocator default: 256 KiB pages x 2 layers x 2 buffers, 4 blocks per page


@pytest.fixture(autouse=True)
def no_idle_return(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep warm pools in place while a test looks at them."""
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")


def listed(name: str) -> dict:
    rows = {r["name"]: r for r in json.loads(kvctl("list", "--json").stdout)}
    return rows[name]



def test_limit_applied_deferred_then_applied_then_lifted(spawn_allocator):
    proc = spawn_allocator("m1", script="b = m.alloc(20)")  # 5 pages in use

    grow = kvctl("limit", "m1", "8MiB")
    assert grow.exit_code == 0, grow.stderr
    assert grow.stdout.startswith("m1: limit 8.0 MiB applied (revision 1,")
    row = listed("m1")
    assert row["limit_bytes"] == 8 * MiB and row["limit_status"] == "applied" and row["applied_revision"] == 1
    assert row["mapped_bytes"] <= 8 * MiB

    shrink = kvctl("limit", "m1", "2.5MiB", "--json")  # rounded down to 2 whole bundles
    assert shrink.exit_code == 0, shrink.stderr
    ack = json.loads(shrink.stdout)[0]
    assert ack == {**ack, "name": "m1", "kind": "limit", "status": "deferred", "revision": 2,
                   "requested_bytes": int(2.5 * MiB), "effective_limit": 2 * MiB}
    row = listed("m1")
    assert row["limit_status"] == "deferred" and row["pages_reserved"] == 0 and row["pages_inuse"] == 5

    send(proc, "m.free(b[8:])")  # 2 pages left in use: the deferred limit now holds
    assert wait_for(lambda: listed("m1")["limit_status"] == "applied")
    assert listed("m1")["mapped_bytes"] <= 2 * MiB
    send(proc, "assert m.alloc(4) is None")  # the limit is enforced in the allocator

    lift = kvctl("limit", "m1", "none")
    assert lift.exit_code == 0 and lift.stdout.startswith("m1: limit lifted (revision 3")
    row = listed("m1")
    assert row["limit_bytes"] is None and row["limit_status"] == "none"
    send(proc, "assert m.alloc(4) is not None")


def test_limit_percent_of_the_capacity(spawn_allocator):
    spawn_allocator("m1")
    capacity = listed("m1")["device_capacity"]
    assert capacity == 2 * 1024 * MiB  # KVCACHED_HOST_CAPACITY from conftest
    done = kvctl("limit", "m1", "0.1%", "--json")
    assert done.exit_code == 0, done.stderr
    ack = json.loads(done.stdout)[0]
    assert ack["requested_bytes"] == int(capacity * 0.001)
    assert ack["effective_limit"] == int(capacity * 0.001) // BUNDLE * BUNDLE


def test_limit_all_and_trim_all(spawn_allocator):
    spawn_allocator("a", script="b = m.alloc(1)")
    spawn_allocator("b", script="b = m.alloc(1)")
    for name in ("a", "b"):  # traffic made each refill its warm pool to the minimum (5 pages)
        assert wait_for(lambda n=name: listed(n)["pages_reserved"] == 5)

    limited = kvctl("limit", "--all", "64MiB")
    assert limited.exit_code == 0, limited.stderr
    assert sorted(line.split(":")[0] for line in limited.stdout.splitlines()) == ["a", "b"]
    assert {listed(n)["limit_bytes"] for n in ("a", "b")} == {64 * MiB}

    trimmed = kvctl("trim", "--all", "--json")
    assert trimmed.exit_code == 0, trimmed.stderr
    acks = json.loads(trimmed.stdout)
    assert [(a["name"], a["status"], a["bytes_returned"]) for a in acks] == [("a", "trimmed", 5 * MiB),
                                                                             ("b", "trimmed", 5 * MiB)]
    assert listed("a")["pages_reserved"] == 0 and listed("a")["trimmed_total"] == 5 * MiB


def test_trim_one_prints_bytes_returned(spawn_allocator):
    proc = spawn_allocator("m1", script="b = m.alloc(3)")
    assert wait_for(lambda: listed("m1")["pages_reserved"] == 5)
    done = kvctl("trim", "m")  # a unique prefix
    assert done.exit_code == 0, done.stderr
    assert done.stdout == (f"m1: returned 5.0 MiB ({5 * MiB} bytes); "
                           "the warm pool refills while traffic lasts; a limit keeps it down\n")
    assert listed("m1")["mapped_bytes"] == BUNDLE  # only the page in use stays mapped
    again = kvctl("trim", "m1")
    assert again.stdout == "m1: returned 0 B (0 bytes)\n"
    send(proc, "assert m.alloc(1)")  # still serving


def test_limit_without_waiting_is_pending(spawn_allocator):
    spawn_allocator("m1")
    done = kvctl("limit", "m1", "4MiB", "--wait", "0")
    assert done.exit_code == 0
    assert "requested (revision 1), not waiting" in done.stdout
    assert wait_for(lambda: listed("m1")["applied_revision"] == 1)


def test_sleep_wait_0_says_what_waiting_would_do(spawn_allocator):
    """--wait 0 writes the request and returns: the answer names the option it was given, not one to add."""
    spawn_allocator("m1", script="m.set_sleep_handler(lambda action: None)")
    done = kvctl("sleep", "m1", "--wait", "0")
    assert done.exit_code == 0, done.stderr
    assert done.stdout == "m1: pending: not asleep yet; --wait N waits up to N seconds\n"
    woken = kvctl("wake", "m1", "--wait", "0")
    assert woken.exit_code == 0, woken.stderr
    assert woken.stdout == "m1: pending: not awake yet; --wait N waits up to N seconds\n"


def test_no_acknowledgement_in_time_exits_1(spawn_allocator):
    proc = spawn_allocator("m1")
    freeze(proc.pid)  # alive and (for ~3 s) fresh, but not answering
    try:
        done = kvctl("limit", "m1", "4MiB", "--wait", "0.3")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert done.exit_code == 1
    # One line; on a slow host it may add that the heartbeat went late meanwhile.
    assert done.stderr.startswith("kvctl: m1 did not acknowledge the limit within 0.3 s")
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n")
    assert wait_for(lambda: listed("m1")["applied_revision"] == 1)  # it applies once it runs again


def test_limit_on_a_legacy_segment_writes_upstreams_field(shm_dir: Path):
    name = f"kvcached_vllm_{os.getpgrp()}"  # a process group that exists: the row is not stale
    path = shm_dir / name
    path.write_bytes(L.LEGACY.pack(0, 3 * MiB, 1 * MiB))
    done = kvctl("limit", "kvcached_vllm", "1GiB")
    assert done.exit_code == 0, done.stderr
    assert f"{name}: limit 1.0 GiB written" in done.stdout
    assert L.LEGACY.unpack(path.read_bytes()) == (1 << 30, 3 * MiB, 1 * MiB)
    assert snapshot(name).limit_bytes == 1 << 30
    lift = kvctl("limit", name, "none")  # upstream would resize its cache to 0
    assert lift.exit_code == 1 and lift.stderr.count("\n") == 1
    assert "upstream kvcached segment, which has no 'no limit': give it a size" in lift.stderr
    assert L.LEGACY.unpack(path.read_bytes())[0] == 1 << 30

    refused = kvctl("trim", name)
    assert refused.exit_code == 1 and "cannot be trimmed" in refused.stderr
    assert refused.stderr.count("\n") == 1


def test_all_reports_each_refusal_and_acts_on_the_others(spawn_allocator, shm_dir: Path):
    if os.getuid() != 0:
        pytest.skip("needs root to give a segment to another user")
    spawn_allocator("ok")
    theirs = spawn_allocator("theirs")
    os.chown(shm_dir / "kvc.theirs", 4321, 4321)
    done = kvctl("limit", "--all", "32MiB")
    assert done.exit_code == 1
    assert done.stdout.startswith("ok: limit 32.0 MiB applied")
    assert done.stderr.count("\n") == 1 and "theirs" in done.stderr and "4321" in done.stderr
    assert listed("theirs")["limit_revision"] == 0
    theirs.kill()
