"""The segment's newer words (TRAFFIC, SLEEP, COMPACT, the heartbeat) under a live writer, forgery and
concurrent controllers: every word a reader shows comes from one whole write; words no allocator writes
read as unknown; each compaction request learns what its own compaction did."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from conftest import child_env, kvctl, send, wait_for

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import read_segment

MiB = 1024 * 1024

# A writer that publishes, as fast as it can from three threads, traffic derived from one step number
# (every field >= 1), sleep words derived from another (capable always), and heartbeats.
CHURN = """
import threading, time
def handler(action):
    pass
m.set_sleep_handler(handler)
stop = threading.Event()
def traffic():
    n = 1
    while not stop.is_set():
        m.publish_traffic(n, n + 1, n, 2 * n, 3 * n, n, n)
        n += 1
def sleep_words():
    n = 1
    while not stop.is_set():
        with m.sleep._lock:
            m.sleep.after_idle_s, m.sleep.slept_bytes, m.sleep.took_ns = n / 1000, n, n
            m.sleep._write()
        n += 1
def beats():
    while not stop.is_set():
        m.segment.heartbeat()
threads = [threading.Thread(target=f, daemon=True) for f in (traffic, sleep_words, beats)]
for t in threads:
    t.start()
"""


def test_a_live_writer_never_shows_a_torn_word(spawn_allocator, shm_dir):
    proc = spawn_allocator("churn", script=CHURN)
    path = shm_dir / "kvc.churn"

    def started() -> bool:
        try:
            snap = read_segment(path)
        except BlockingIOError:  # the writer published throughout the read: look again
            return False
        return snap.traffic is not None and snap.sleep is not None and snap.sleep.slept_bytes >= 1

    wait_for(started, what="the first traffic figures and sleep words of the writer's threads")
    problems: list[str] = []
    last_finished = last_slept = 0
    reads = 0
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        try:
            snap = read_segment(path)
        except BlockingIOError:
            continue
        reads += 1
        t, s = snap.traffic, snap.sleep
        if t is None or s is None:
            problems.append(f"read {reads}: traffic {t}, sleep {s}")
            continue
        fields = (t.running, t.waiting, t.finished, t.prompt_tokens, t.generated_tokens, t.preemptions,
                  t.last_request_ns)
        n = t.running
        if fields != (n, n + 1, n, 2 * n, 3 * n, n, n):
            problems.append(f"read {reads}: traffic fields of different steps or zeros: {fields}")
        if t.finished < last_finished:
            problems.append(f"read {reads}: finished went back from {last_finished} to {t.finished}")
        last_finished = max(last_finished, t.finished)
        if not s.capable or s.state != "awake":
            problems.append(f"read {reads}: sleep read as {s}")
        elif not (s.slept_bytes >= 1 and s.after_idle_s == s.slept_bytes / 1000 and s.took_s == s.slept_bytes / 1e9):
            problems.append(f"read {reads}: sleep words of different writes or zeros: {s}")
        elif s.slept_bytes < last_slept:
            problems.append(f"read {reads}: sleep words went back from {last_slept} to {s.slept_bytes}")
        else:
            last_slept = s.slept_bytes
        if not snap.heartbeat_ns or snap.late:
            problems.append(f"read {reads}: heartbeat {snap.heartbeat_ns} (late {snap.late})")
    send(proc, "stop.set()")
    assert reads > 100
    assert not problems, f"{len(problems)} bad reads of {reads}: {problems[:5]}"


# -- forged words ----------------------------------------------------------------------------------

def exported(name: str) -> list:
    """The exporter's samples for model ``name``."""
    from kvtop.serve.exporter import KVCachedCollector

    return [s for family in KVCachedCollector(with_nvml=False).collect() for s in family.samples
            if s.labels.get("model") == name]


def seal(path: Path, region: str, payload: bytes, seq: int = 1 << 40) -> None:
    """Write a sealed block as a forger who knows the format would: whole, with a check that matches."""
    off, size = L.SEALED[region]
    assert len(payload) == size
    with open(path, "r+b") as fh:
        fh.seek(off)
        fh.write(L.U64.pack(seq) + payload + L.U64.pack(zlib.crc32(payload) ^ (seq & 0xFFFFFFFF)))


IDLE = "m.set_sleep_handler(lambda action: None)\nb = m.alloc(4)\n"


@pytest.mark.parametrize("words", [
    dict(after_idle_ms=2**63 - 1), dict(slept_bytes=2**64 - 1), dict(took_ns=2**64 - 1), dict(state=7),
    dict(state=L.SLEEP_ASLEEP), dict(acked_revision=2**64 - 1), dict(capable=5),
], ids=["after_idle", "slept_bytes", "took", "state", "asleep_over_mapped", "acked_revision", "capable"])
def test_forged_sleep_words_read_as_unknown(spawn_allocator, shm_dir, words):
    spawn_allocator("forged", script=IDLE)
    path = shm_dir / "kvc.forged"
    values = dict(capable=1, state=L.SLEEP_AWAKE, acked_revision=0, after_idle_ms=-1, slept_bytes=0, took_ns=0)
    values.update(words)
    seal(path, "sleep", L.SLEEP.pack(*(values[k] for k in L.SLEEP_FIELDS)))
    snap = kc.snapshot("forged")
    assert snap.mapped_bytes > 0 and snap.sleep is not None
    assert (snap.sleep.state, snap.sleep.acked_revision, snap.sleep.after_idle_s) == ("unknown", 0, None)
    assert snap.sleep.capable == (values["capable"] == 1)
    samples = exported("forged")
    assert not [s for s in samples if s.name.endswith("slept_bytes")]
    assert {s.labels["state"]: s.value for s in samples if s.name.endswith("sleep_state")} == \
        {"awake": 0, "draining": 0, "asleep": 0}
    listed = json.loads(kvctl("list", "--json").stdout)
    (row,) = [r for r in listed if r["name"] == "forged"]
    assert row["sleep"] == {"state": "unknown", "after_idle_s": None, "slept_bytes": None,
                            "capable": values["capable"] == 1}


def test_a_forged_acknowledged_sleep_revision_never_answers_a_request(spawn_allocator, shm_dir):
    """An acked revision of 2^64-1 is no later request: kvctl sleep is answered by the model itself."""
    proc = spawn_allocator("acked", script="m.set_sleep_handler(lambda action: m.sleep.ready() if action != 'wake' else None)\n")
    path = shm_dir / "kvc.acked"
    seal(path, "sleep", L.SLEEP.pack(1, L.SLEEP_AWAKE, 2**64 - 1, -1, 0, 0))
    done = kvctl("sleep", "acked", "--json")
    assert "later request" not in done.stdout + done.stderr
    assert done.exit_code == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["state"] == "asleep" and not answer.get("superseded")
    assert kc.snapshot("acked").sleep.state == "asleep"
    send(proc, "m.sleep.wake()")


@pytest.mark.parametrize("words", [
    dict(published=0xDEAD), dict(running=2**64 - 1), dict(waiting=2**64 - 1), dict(finished=2**64 - 1),
    dict(generated_tokens=2**63),
], ids=["published", "running", "waiting", "finished", "generated"])
def test_forged_traffic_words_read_as_unknown(spawn_allocator, shm_dir, words):
    spawn_allocator("traffic", script="m.publish_traffic(1, 0, 1, 10, 10, 0, 1)\n")
    path = shm_dir / "kvc.traffic"
    assert kc.snapshot("traffic").traffic is not None
    values = dict(published=1, running=1, waiting=0, finished=1, prompt_tokens=10, generated_tokens=10,
                  preemptions=0, last_request_ns=1)
    values.update(words)
    seal(path, "traffic", L.TRAFFIC.pack(*(values[k] for k in L.TRAFFIC_FIELDS)))
    assert kc.snapshot("traffic").traffic is None
    assert not [s for s in exported("traffic") if "request" in s.name or "tokens" in s.name]


def compact_payload(head: dict, answers: list[tuple[int, int, int, int, int]] = ()) -> bytes:
    values = dict(capable=1, status=0, acked_seq=0, compactions=0, blocks_moved=0, bytes_copied=0,
                  bytes_returned=0, took_ns=0)
    values.update(head)
    rows = [*answers, *[(0, 0, 0, 0, 0)] * (L.COMPACT_ANSWERS - len(answers))]
    return L.COMPACT_PAYLOAD.pack(*(values[k] for k in L.COMPACT_FIELDS), *(w for row in rows for w in row))


@pytest.mark.parametrize("head", [
    dict(bytes_returned=2**64 - 1), dict(bytes_copied=2**64 - 1), dict(compactions=2**64 - 1),
    dict(blocks_moved=3, bytes_copied=5), dict(took_ns=2**64 - 1),
], ids=["returned", "copied", "compactions", "copied_not_blocks", "took"])
def test_forged_compaction_totals_read_as_unknown(spawn_allocator, shm_dir, head):
    spawn_allocator("packed")
    seal(shm_dir / "kvc.packed", "compact", compact_payload(head))
    info = kc.snapshot("packed").compaction
    assert info is not None and info.capable
    assert (info.compactions, info.blocks_moved, info.bytes_copied, info.bytes_returned, info.took_s) == (None,) * 5
    shown = kvctl("frag", "packed")
    assert shown.exit_code == 0 and "unknown" in shown.stdout


def test_a_forged_compaction_answer_is_not_taken(spawn_allocator, shm_dir):
    """An acknowledged request never made reads as 0, and answers beyond it are left out."""
    spawn_allocator("answers")
    seal(shm_dir / "kvc.answers", "compact",
         compact_payload(dict(acked_seq=2**64 - 1), [(1, 2**64 - 1, 0, 2**64 - 1, 2**64 - 1)]))
    info = kc.snapshot("answers").compaction
    assert info is not None and info.acked_seq == 0 and info.answers == ()


# -- two controllers at once: each learns what its own compaction did ------------------------------

COMPACTABLE = dict(num_blocks=16 * 8, block_bytes=256 * 1024, num_layers=8, page_size=2 * MiB, policy="best-fit")
BUNDLE = 32 * MiB
SCATTER = """
from kvcached_core.allocator.compact import host_copy
ids = [m.alloc(1)[0] for _ in range(64)]
drop = [b for b in ids if (b // 8 < 4 and b % 8 < 2) or (b // 8 >= 4 and b % 8 >= 2)]
m.free(drop)
m.mark_cached([b for b in ids if b not in drop])
m.set_compact_handler(lambda moves: host_copy(m.backend, m.block_bytes, moves))
"""


@pytest.fixture
def _no_idle_return(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")


def start_kvctl(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtop.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def requested(path: Path) -> int:
    with open(path, "rb") as fh:
        return L.U64.unpack(os.pread(fh.fileno(), 8, L.COMPACT_REQ_OFF))[0]


def unlocked(path: Path) -> bool:
    """No controller holds the segment's lock now (one that wrote its request lets go before it waits)."""
    with open(path, "rb") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        return True


def stopped_controller(model: subprocess.Popen, path: Path, seq: int) -> subprocess.Popen:
    """``kvctl compact`` asking for request ``seq``, stopped (SIGSTOP) before its answer can come."""
    send(model, "m.lock.acquire()")  # the allocator's poller waits for it
    controller = start_kvctl("compact", "cc", "--json", "--wait", "60")
    try:
        wait_for(lambda: requested(path) == seq and unlocked(path), what=f"request {seq}, its lock let go")
        os.kill(controller.pid, signal.SIGSTOP)
    finally:
        send(model, "m.lock.release()")
    return controller


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_two_controllers_at_once_each_learn_their_own_compaction(spawn_allocator, shm_dir, _no_idle_return):
    """A slow controller whose request was answered before another's still reports its own compaction's
    bytes, not the later one's 0 B; requests made while the allocator is busy are folded into one
    compaction and both say so with its figures."""
    proc = spawn_allocator("cc", script=SCATTER, **COMPACTABLE)
    path = shm_dir / "kvc.cc"
    assert kc.snapshot("cc").pages_inuse == 8

    # The first controller asks, and is stopped before it can read its answer (the allocator is held busy
    # until then).
    first = stopped_controller(proc, path, 1)
    try:
        wait_for(lambda: kc.snapshot("cc").compaction.acked_seq == 1, what="the first answer")
        second = kvctl("compact", "cc", "--json")  # answered by a compaction that finds nothing to move
        assert second.exit_code == 0, second.stderr
        assert json.loads(second.stdout)["bytes_returned"] == 0
    finally:
        os.kill(first.pid, signal.SIGCONT)
    own = finish(first)
    assert (own["status"], own["bytes_returned"], own.get("answered_with")) == ("compacted", 4 * BUNDLE, [1, 1])
    assert own["bytes_copied"] == 8 * 256 * 1024 * 8 * 2  # 8 blocks moved, every layer, K and V

    # Two controllers while the allocator is busy (its lock held): one compaction answers both.
    send(proc, "ids2 = [m.alloc(1)[0] for _ in range(8)]; m.free(ids2[::2]); m.mark_cached(ids2[1::2])")
    send(proc, "m.lock.acquire()")
    both = [start_kvctl("compact", "cc", "--json", "--wait", "60") for _ in range(2)]
    wait_for(lambda: requested(path) == 4, what="both requests")
    send(proc, "m.lock.release()")
    answers = [finish(p) for p in both]
    assert [a["answered_with"] for a in answers] == [[3, 4], [3, 4]]
    assert answers[0]["bytes_returned"] == answers[1]["bytes_returned"]
    assert answers[0]["bytes_copied"] == answers[1]["bytes_copied"]

    # A controller stopped until its answer has left the allocator's record: figures unknown, never 0 B.
    late = stopped_controller(proc, path, 5)
    try:
        wait_for(lambda: kc.snapshot("cc").compaction.acked_seq == 5, what="the late request's answer")
        for _ in range(L.COMPACT_ANSWERS):
            assert kvctl("compact", "cc").exit_code == 0
    finally:
        os.kill(late.pid, signal.SIGCONT)
    gone = finish(late)
    assert (gone["status"], gone["bytes_returned"], gone["bytes_copied"]) == ("answered", None, None)
    text = kvctl("compact", "cc")
    assert text.exit_code == 0 and "returned 0 B" in text.stdout


@pytest.mark.parametrize("region", ["traffic", "sleep", "compact"])
def test_a_sealed_block_that_fails_its_check_reads_as_unknown(spawn_allocator, shm_dir, region):
    """A damaged block in a quiet segment: that block is unknown, the model and its counters are read as usual."""
    spawn_allocator("damaged", script="m.publish_traffic(1, 0, 1, 10, 10, 0, 1)\nb = m.alloc(4)\n")
    path = shm_dir / "kvc.damaged"
    off, size = L.SEALED[region]
    with open(path, "r+b") as fh:
        check = L.U64.unpack(os.pread(fh.fileno(), 8, off + 8 + size))[0]
        os.pwrite(fh.fileno(), L.U64.pack(check ^ 1), off + 8 + size)
    snap = kc.snapshot("damaged")
    assert snap.status == "live" and snap.blocks_used == 4
    shown = {"traffic": snap.traffic, "sleep": snap.sleep.state, "compact": snap.compaction.compactions}
    assert shown[region] in (None, "unknown")
    assert [k for k, v in shown.items() if v in (None, "unknown")] == [region]
