"""Hostile hosts: files swapped under a cleaner, names reused, locks held by others, full tmpfs,
other pid namespaces, forged segments. Real processes and real files throughout."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import child_env, freeze, kvctl, wait_for, wait_heartbeat_late

import kvcached_core as kc
from kvcached_core.backends.ledger import LOCK_NAME
from kvcached_core.segment import layout as L
from kvcached_core.segment import liveness, procinfo
from kvcached_core.segment.removal import RemovalConflict, inode, remove_verified

SMALL = dict(num_blocks=64, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)


def dead_segment(spawn_allocator, name: str) -> Path:
    proc = spawn_allocator(name)
    proc.kill()
    proc.wait()
    return Path(os.environ["KVCACHED_SHM_DIR"]) / f"kvc.{name}"


# -- item 1: delete only the inode that was verified -----------------------------------------

def test_remove_verified_leaves_a_file_that_is_not_the_checked_one(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"first")
    checked = inode(os.lstat(path))
    (tmp_path / "g").write_bytes(b"theirs")
    os.rename(tmp_path / "g", path)  # swapped in after the check
    assert remove_verified(path, checked) is False
    assert path.read_bytes() == b"theirs"

    now = inode(os.lstat(path))
    assert remove_verified(path, now, lambda fd: False) is False  # the re-check says no: put back
    assert inode(os.lstat(path)) == now and sorted(os.listdir(tmp_path)) == ["f"]
    assert remove_verified(path, now, lambda fd: os.pread(fd, 6, 0) == b"theirs") is True
    assert os.listdir(tmp_path) == []


def test_remove_verified_never_puts_back_over_a_newcomer(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    checked = inode(os.lstat(path))

    def newcomer_arrives(fd: int) -> bool:
        path.write_bytes(b"newcomer")  # the name is taken while the old file is held privately
        return False

    with pytest.raises(RemovalConflict, match="replaced twice"):
        remove_verified(path, checked, newcomer_arrives)
    assert path.read_bytes() == b"newcomer"
    (kept,) = [p for p in tmp_path.iterdir() if p.name != "f"]
    assert kept.read_bytes() == b"old" and inode(os.lstat(kept)) == checked


def test_remove_verified_moves_a_symlink_back_without_following_it(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert remove_verified(link, inode(os.stat(target))) is False
    assert link.is_symlink() and target.read_bytes() == b"keep"


SWAPPER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/select.h>
#include <unistd.h>
/* Exchange two names as fast as possible (RENAME_EXCHANGE: neither file is ever lost) until stdin
   closes; with a third argument, move the file at argv[1] to argv[2] and back instead. */
int main(int argc, char **argv) {
    long swaps = 0;
    for (;;) {
        for (int i = 0; i < 256; i++)
            if (argc > 3 ? rename(argv[1], argv[2]) == 0 && rename(argv[2], argv[1]) == 0
                         : renameat2(AT_FDCWD, argv[1], AT_FDCWD, argv[2], RENAME_EXCHANGE) == 0) swaps++;
        fd_set in; FD_ZERO(&in); FD_SET(0, &in);
        struct timeval now = {0, 0};
        if (select(1, &in, NULL, NULL, &now) > 0) break;
    }
    printf("%ld\n", swaps);
    return 0;
}
"""


def swapper(tmp_path: Path, a: Path, b: Path, *, move: bool = False) -> subprocess.Popen:
    source = tmp_path / "swap.c"
    source.write_text(SWAPPER_C)
    subprocess.run(["cc", "-O2", "-o", str(tmp_path / "swap"), str(source)], check=True)
    return subprocess.Popen([str(tmp_path / "swap"), str(a), str(b), *(["move"] if move else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_clean_never_deletes_a_file_swapped_in_while_it_works(spawn_allocator, shm_dir, tmp_path):
    """A user's file is exchanged with a stale segment over and over while kvctl clean runs."""
    dead = dead_segment(spawn_allocator, "dead")
    wait_heartbeat_late(dead)  # clean keeps a segment whose heartbeat is fresh
    template = dead.read_bytes()
    precious = shm_dir / "precious.txt"
    precious.write_bytes(b"a user's file")
    mine = inode(os.lstat(precious))
    swapping = swapper(tmp_path, precious, dead)
    removed = 0
    try:
        for _ in range(1500):  # the old check-then-unlink lost the user's file in most runs of 600
            if not os.path.lexists(dead):  # clean removed a stale copy: give the swapper another
                tmp = shm_dir / ".next"
                tmp.write_bytes(template)
                os.chmod(tmp, 0o600)
                os.link(tmp, dead)  # the swapper only exchanges: while one name is missing it waits
                tmp.unlink()
            result = kvctl("clean")
            assert result.exit_code == 0, result.output
            removed += result.stdout.count("removed ")
    finally:
        swapping.stdin.close()
        swaps = int(swapping.stdout.readline())
        swapping.wait()
    survivors = [p for p in shm_dir.iterdir() if inode(os.lstat(p)) == mine]
    assert len(survivors) == 1 and survivors[0].read_bytes() == b"a user's file"
    assert removed >= 1 and swaps > 100  # the cleaner did act, and the files did move under it


# -- item 2: close() removes only its own inode ----------------------------------------------

def test_close_never_removes_the_segment_of_the_next_holder_of_the_name(shm_dir):
    first = kc.KVCacheManager("shared", name="shared", **SMALL)
    os.unlink(shm_dir / "kvc.shared")  # removed under it (an operator, a cleaner)
    with kc.KVCacheManager("shared", name="shared", **SMALL) as second:
        first.close()
        (snap,) = kc.list_models()
        assert (snap.name, snap.status, snap.pid) == ("shared", "live", os.getpid())
        assert inode(os.lstat(shm_dir / "kvc.shared")) == second.segment.inode
    assert kc.list_models() == []  # its own close still removes its own segment


# -- item 4: never wait on a lock another process holds ---------------------------------------

HOLD_LOCK = textwrap.dedent("""
    import fcntl, os, signal, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
""")

GROW_CLOSE = textwrap.dedent("""
    import kvcached_core as kc
    m = kc.KVCacheManager("grower", name="grower", num_blocks=64, block_bytes=1 << 16, num_layers=1,
                          page_size=1 << 18)
    print("alloc", m.alloc(8) is not None, flush=True)  # an empty pool: alloc maps, claiming capacity
    print("limit", kc.request_limit("grower", 4 << 18, wait=5).status, flush=True)
    m.close()
    print("closed", flush=True)
""")


@pytest.mark.parametrize("owner", ["ours", "another user's, open to all"])
def test_a_stopped_holder_of_the_capacity_lock_never_hangs_the_allocator(shm_dir, owner):
    if owner != "ours" and os.getuid() != 0:
        pytest.skip("needs root to give the lock file to another user")
    lock = shm_dir / LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        if owner != "ours":
            os.chown(lock, 4321, 4321)
            os.chmod(lock, 0o666)
        env = dict(child_env(), KVCACHED_MIN_RESERVED_PAGES="0", KVCACHED_MAX_RESERVED_PAGES="0")
        done = subprocess.run([sys.executable, "-c", GROW_CLOSE], env=env, capture_output=True, text=True,
                              timeout=60)  # the old blocking flock never returned
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == ["alloc True", "limit applied", "closed", ""]


def test_claims_made_without_the_lock_still_respect_the_capacity(shm_dir):
    """Claimers that skip a held lock record their claim before counting the others'."""
    one, two = (kc.KVCacheManager(n, name=n, **SMALL) for n in ("one", "two"))
    try:
        ledger_one, ledger_two = one.backend.ledger, two.backend.ledger
        ledger_one.capacity = ledger_two.capacity = 10 * one.bundle_bytes
        fd = ledger_one._lock()  # held for the whole test: every claim below goes without it
        try:
            granted = 0
            while ledger_one.claim(one.bundle_bytes) | ledger_two.claim(one.bundle_bytes):
                granted += 1
            held = ledger_one.claimed + ledger_two.claimed
        finally:
            ledger_one._unlock(fd)
    finally:
        one.close()
        two.close()
    assert granted > 0 and held <= 10 * one.bundle_bytes


# -- item 3: engines in another pid namespace --------------------------------------------------

CONTAINER_ENGINE = textwrap.dedent("""
    import os, sys
    import kvcached_core as kc
    m = kc.KVCacheManager("boxed", name="boxed", num_blocks=64, block_bytes=1 << 16, num_layers=1,
                          page_size=1 << 18)
    assert m.alloc(8) is not None
    print("READY", os.getpid(), flush=True)
    sys.stdin.read()
    m.close()
""")


def test_an_engine_in_another_pid_namespace_is_live_counted_and_never_cleaned(shm_dir):
    if os.getuid() != 0:
        pytest.skip("needs root to make a pid namespace")
    box = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", CONTAINER_ENGINE],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        ready, inner_pid = box.stdout.readline().split()
        assert ready == "READY"
        (snap,) = kc.list_models()
        assert (snap.name, snap.pid, snap.status, snap.late) == ("boxed", int(inner_pid), "live", False)
        assert snap.pid_ns not in (0, liveness.own_pid_ns())
        done = kvctl("clean")
        assert (done.exit_code, done.stdout) == (0, "nothing to clean\n")
        with kc.KVCacheManager("host", name="host", **SMALL) as here:
            assert here.backend.ledger._others() >= 8 * (1 << 16)  # its claim counts against the capacity
    finally:
        box.stdin.close()
        box.wait(timeout=30)
    assert kc.list_models() == []


def forge(path: Path, **fields: int) -> None:
    """Rewrite header fields (and ``heartbeat_ns`` / ``claimed``) of a real segment file in place."""
    raw = bytearray(path.read_bytes())
    header = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0), strict=True))
    heartbeat, claimed = fields.pop("heartbeat_ns", None), fields.pop("claimed", None)
    header.update(fields)
    L.HEADER.pack_into(raw, 0, *header.values())
    if heartbeat is not None:
        L.U64.pack_into(raw, L.HEARTBEAT_OFF, heartbeat)
    if claimed is not None:
        L.U64.pack_into(raw, L.CLAIMED_OFF, claimed)
    path.write_bytes(raw)


@pytest.mark.parametrize(("age_s", "status", "cleaned"), [(10, "live", False), (40, "stale", True)])
def test_a_writer_in_another_pid_namespace_is_judged_by_its_heartbeat(spawn_allocator, age_s, status, cleaned):
    path = dead_segment(spawn_allocator, "far")
    forge(path, pid_ns=liveness.own_pid_ns() + 1, heartbeat_ns=time.time_ns() - age_s * 10**9)
    (snap,) = kc.list_models()
    assert (snap.status, snap.late) == (status, status == "live")
    done = kvctl("clean")
    assert done.exit_code == 0 and path.exists() is not cleaned


def test_a_segment_whose_heartbeat_is_fresh_is_never_cleaned_even_with_its_pid_gone(spawn_allocator):
    path = dead_segment(spawn_allocator, "justdied")
    forge(path, heartbeat_ns=time.time_ns())  # its process is gone, its heartbeat says it beat just now
    (snap,) = kc.list_models()
    assert snap.status == "stale"
    done = kvctl("clean")
    assert done.exit_code == 0 and path.exists()
    assert "kept" in done.stderr and "heartbeat is fresh" in done.stderr
    forge(path, heartbeat_ns=time.time_ns() - 10 * 10**9)  # a few seconds on: gone and quiet
    assert kvctl("clean").exit_code == 0 and not path.exists()


# -- item 10: forged segments ------------------------------------------------------------------

@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_forged_claim_of_the_whole_machine_is_not_trusted(spawn_allocator, sleeper, monkeypatch):
    path = dead_segment(spawn_allocator, "hog")
    forge(path, pid=sleeper.pid, start_time=procinfo.start_time(sleeper.pid), heartbeat_ns=time.time_ns(),
          claimed=2**62)
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    with kc.KVCacheManager("victim", name="victim", **SMALL) as m:
        assert m.alloc(8) is not None  # the old ledger summed the forged 2^62 bytes and refused every page


def test_pid_1_with_no_start_time_does_not_live_forever(spawn_allocator):
    path = dead_segment(spawn_allocator, "immortal")
    forge(path, pid=1, start_time=0, heartbeat_ns=time.time_ns() - 60 * 10**9)
    (snap,) = kc.list_models()
    assert snap.status == "stale"
    assert kvctl("clean").exit_code == 0 and not path.exists()


def test_a_claim_in_a_file_naming_another_users_process_is_not_counted(spawn_allocator):
    if os.getuid() != 0:
        pytest.skip("needs root to give the file to another user")
    path = dead_segment(spawn_allocator, "borrowed")
    forge(path, pid=1, start_time=procinfo.start_time(1), heartbeat_ns=time.time_ns(), claimed=1 << 20)
    os.chown(path, 4321, 4321)  # pid 1 runs as root, the file belongs to uid 4321
    with kc.KVCacheManager("counter", name="counter", **SMALL) as m:
        assert m.backend.ledger._others() == 0
        os.chown(path, 0, 0)
        assert m.backend.ledger._others() == 1 << 20  # the same claim, now by the process's owner


@pytest.mark.parametrize("writer", ["running", "gone"])
def test_a_heartbeat_from_the_future_is_late_not_fresh(spawn_allocator, sleeper, writer):
    path = dead_segment(spawn_allocator, "future")
    if writer == "running":
        forge(path, pid=sleeper.pid, start_time=procinfo.start_time(sleeper.pid), heartbeat_ns=time.time_ns() + 3600 * 10**9)
    else:
        forge(path, start_time=0, heartbeat_ns=time.time_ns() + 3600 * 10**9)
    (snap,) = kc.list_models()
    assert (snap.status, snap.late, snap.display_status) == (
        ("live", True, "late") if writer == "running" else ("stale", False, "stale"))


# -- item 9: one liveness verdict: a stopped allocator is late, not gone -----------------------

def test_a_stopped_allocator_is_listed_late_kept_by_clean_and_not_called_gone(spawn_allocator, shm_dir):
    proc = spawn_allocator("paused")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: kc.list_models()[0].late, what="the heartbeat to go late")
        listed = kvctl("list")
        assert listed.exit_code == 0 and "paused" in listed.stdout and " late " in listed.stdout
        limited = kvctl("limit", "paused", "1MiB", "--wait", "0.5")
        cleaned = kvctl("clean")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert limited.exit_code == 1
    assert limited.stderr == ("kvctl: paused did not acknowledge the limit within 0.5 s; its process runs but its "
                              "heartbeat is late (stopped or overloaded)\n")
    assert cleaned.stdout == "nothing to clean\n" and "still runs" in cleaned.stderr
    assert (shm_dir / "kvc.paused").exists()
    wait_for(lambda: kc.snapshot("paused").applied_revision == 1, what="the limit once it runs again")


# -- item 5: a full tmpfs never SIGBUSes the engine --------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """A real 64 KiB tmpfs as the segment directory (a container's /dev/shm, only smaller)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(mount))
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


BIG_SEGMENT = dict(num_blocks=40000, block_bytes=4096, num_layers=1, page_size=4096)  # a 160 KB page map

USE_ALL_PAGES = textwrap.dedent("""
    import sys
    import kvcached_core as kc
    try:
        m = kc.KVCacheManager("big", name="big", **{params!r})
    except kc.SegmentError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    print("started", flush=True)
    sys.stdin.readline()  # the tmpfs is filled meanwhile
    ids = [m.alloc(1) for _ in range({n})]
    m.free([i for chunk in ids if chunk for i in chunk])
    m.close()
    print("done", flush=True)
""")


def test_a_segment_that_does_not_fit_the_tmpfs_fails_at_start_in_one_line(small_tmpfs):
    done = subprocess.run([sys.executable, "-c", USE_ALL_PAGES.format(params=BIG_SEGMENT, n=1)],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, f"killed by signal {-done.returncode}" if done.returncode < 0 else done.stderr
    assert done.stderr.startswith(f"no room for segment {small_tmpfs}/kvc.big: it needs ")
    assert done.stderr.count("\n") == 1 and os.listdir(small_tmpfs) == []


def test_a_tmpfs_that_fills_after_start_does_not_kill_the_engine(small_tmpfs):
    fits = dict(BIG_SEGMENT, num_blocks=8000)  # a 32 KB page map: fits, with room left
    child = subprocess.Popen([sys.executable, "-c", USE_ALL_PAGES.format(params=fits, n=8000)], env=child_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "started\n", child.stderr.read()
        with open(small_tmpfs / "filler", "wb", buffering=0) as fh, pytest.raises(OSError, match="No space left"):
            while True:  # another program (NCCL, say) takes the rest of /dev/shm
                fh.write(bytes(4096))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0, child.stderr.read()
        assert child.stdout.readline() == "done\n"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        (small_tmpfs / "filler").unlink(missing_ok=True)


# -- item 11: limits near int64 -----------------------------------------------------------------

@pytest.mark.parametrize("value", [2**63, 2**64, 1.5, True])
def test_a_limit_beyond_int64_is_refused_by_the_api(spawn_allocator, shm_dir, value):
    spawn_allocator("m1")
    before = (shm_dir / "kvc.m1").read_bytes()[L.CONTROL_OFF:L.LIVENESS_OFF]
    with pytest.raises(kc.ControlError, match="beyond the largest a segment holds|whole number of bytes"):
        kc.request_limit("m1", value)
    assert (shm_dir / "kvc.m1").read_bytes()[L.CONTROL_OFF:L.LIVENESS_OFF] == before
    with kc.KVCacheManager("own", name="own", **SMALL) as m, pytest.raises(ValueError, match="limit"):
        m.set_limit(value)


def test_the_largest_limit_is_exact_and_applies(spawn_allocator):
    spawn_allocator("m1")
    done = kvctl("limit", "m1", "9223372036854775807B")
    assert done.exit_code == 0 and " applied " in done.stdout, done.stderr
    assert kc.snapshot("m1").requested_limit == 2**63 - 1


def test_kvtops_limit_dialog_refuses_a_limit_beyond_int64():
    from kvtop.screen.widgets.modals import SizeValidator

    verdict = SizeValidator(None).validate("8388608TiB")
    assert not verdict.is_valid and "beyond the largest size" in verdict.failure_descriptions[0]
    assert SizeValidator(None).validate("8388607TiB").is_valid


# -- item 6: "applied" only when everything resident, in flight included, fits ------------------

def test_a_limit_is_not_applied_while_the_refill_maps_past_it(monkeypatch):
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "60")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "60")
    with kc.KVCacheManager("inflight", name="inflight", num_blocks=128, block_bytes=1 << 20, num_layers=1,
                           page_size=2 << 20) as m:  # a 4 MiB bundle: a 60-page batch takes a while to map
        assert m.alloc(1) is not None  # the pool is empty: the refill thread takes a 60-page batch
        wait_for(lambda: m.pages.inflight > 0, what="a batch in flight")
        status = m.set_limit(m.bundle_bytes)
        resident = m.pages.mapped_pages + m.pages.inflight
        # applied means it fits (the old code said applied with the 60-page batch still mapping);
        # a batch that takes longer than the wait (a loaded machine) leaves it deferred meanwhile
        assert (status, resident) == ("applied", 1) or (status == "deferred" and m.pages.inflight)


# -- item 7: a controller that died mid-write leaves no torn request behind ---------------------

def test_a_torn_limit_record_never_blocks_trims_or_later_limits(spawn_allocator, shm_dir):
    spawn_allocator("m1", script="ids = m.alloc(4)")
    path = shm_dir / "kvc.m1"
    with open(path, "r+b") as fh:  # what a controller killed before its last store leaves: limit and check, old revision
        fh.seek(L.LIMIT_OFF)
        fh.write(L.I64.pack(1 << 20))
        fh.seek(L.LIMIT_CHECK_OFF)
        fh.write(L.U64.pack(L.limit_check(1 << 20, 1)))
    trimmed = kc.request_trim("m1", wait=5)  # the old allocator ignored every trim until a later limit
    assert trimmed.status == "trimmed"
    limited = kc.request_limit("m1", 4 << 20, wait=5)
    assert (limited.status, limited.revision, kc.snapshot("m1").limit_bytes) == ("applied", 1, 4 << 20)


# -- item 8: a superseded request says so --------------------------------------------------------

def test_a_limit_superseded_by_another_controller_says_so(spawn_allocator):
    proc = spawn_allocator("m1")
    freeze(proc.pid)  # both requests land before the model looks
    try:
        first = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "limit", "m1", "1MiB", "--wait", "20"],
                                 env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: kc.snapshot("m1").limit_revision == 1, what="the first request")
        second = kc.request_limit("m1", 2 << 20, wait=0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=30)
    assert first.returncode == 1
    assert out == ("m1: limit request (revision 1) superseded by revision 2 from another controller, "
                   "which holds now: limit 2.0 MiB applied\n")
    assert err == "kvctl: m1: revision 1 was superseded by revision 2\n"
    assert second.revision == 2
    ack = kc.request_limit("m1", 3 << 20, wait=5)
    assert (ack.status, ack.superseded_by) == ("applied", 0)


# -- item 16: escape sequences in a segment's strings never reach the terminal -------------------

EVIL_MODEL = "\x1b[2Jevil\x07model\u202e"
EVIL_ENGINE = "\x1b]0;pwned\x07"


def test_control_characters_in_segment_strings_are_never_printed(shm_dir):
    with kc.KVCacheManager(EVIL_MODEL, name="evil", engine=EVIL_ENGINE, **SMALL):
        outputs = evil_outputs(shm_dir)
    for what, text in outputs.items():
        assert "evil" in text, what
        assert not [c for c in text if not (c.isprintable() or c == "\n")], f"{what}: {text!r}"
    assert "?[2Jevil?model?" in outputs["show"] and "?]0;pwned?" in outputs["show"]
    assert "kvcached_?[31mred_77" in outputs["list"]


def evil_outputs(shm_dir: Path) -> dict[str, str]:
    legacy = shm_dir / "kvcached_\x1b[31mred_77"
    legacy.write_bytes(L.LEGACY.pack(1 << 30, 1 << 20, 0))
    return {
        "list": kvctl("list").stdout, "list --all": kvctl("list", "--all").output,
        "show": kvctl("show", "evil").stdout, "csv": kvctl("watch", "--format", "csv", "--count", "1", "evil").stdout,
        "once": subprocess.run([sys.executable, "-m", "kvtop.app", "--once"], env=child_env(), capture_output=True,
                               text=True, timeout=60).stdout,
    }


# -- item 17: a path swapped while snapshot() reads it -------------------------------------------

def test_snapshot_never_lets_file_not_found_escape_while_a_path_is_swapped(spawn_allocator, shm_dir):
    """The path vanishes between the scan that found it and the read: the scan dwells on an upstream
    file whose lock a hung engine holds (0.1 s), while the segment is moved aside and back."""
    spawn_allocator("swapped")
    hung = shm_dir / "kvcached_vllm_4242"  # sorts after kvc.*: the scan reaches it once it has read kvc.swapped
    hung.write_bytes(L.LEGACY.pack(1 << 30, 0, 0))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(hung)], stdout=subprocess.PIPE, text=True)
    path, aside = shm_dir / "kvc.swapped", shm_dir / ".aside"
    outcomes = []
    try:
        assert holder.stdout.readline() == "held\n"
        for _ in range(3):
            mover = threading.Timer(0.05, os.rename, (path, aside))
            mover.start()
            try:
                outcomes.append(kc.snapshot("swap").name)  # a prefix: found by the scan, then read
            except kc.ModelNotFound:
                outcomes.append("not found")
            finally:
                mover.join()
                os.rename(aside, path)
    finally:
        holder.kill()
        holder.wait()
    assert len(outcomes) == 3  # the old snapshot() raised FileNotFoundError here


# -- item 12: a manager dropped without close() releases everything ------------------------------

def kvc_threads() -> int:
    return sum(t.name.startswith("kvc-") for t in threading.enumerate())


@pytest.mark.parametrize("fastpath", ["0", "auto"])
def test_managers_dropped_without_close_release_threads_fds_memory_and_segments(shm_dir, monkeypatch, fastpath):
    """Their threads hold them only while a step runs; the C path's reference cycle goes with the collector."""
    monkeypatch.setenv("KVCACHED_FASTPATH", fastpath)
    kc.KVCacheManager("first", name="first", **SMALL).close()  # what a process sets up once (the poller's bell)
    wait_for(lambda: kvc_threads() == 0, what="no allocator threads")
    fds = len(os.listdir("/proc/self/fd"))
    threads = kvc_threads()
    for i in range(20):
        m = kc.KVCacheManager(f"dropped{i}", name=f"dropped{i}", **SMALL)
        assert m.alloc(4) is not None
        del m  # never closed
    wait_for(lambda: gc.collect() >= 0 and kvc_threads() == threads, what="the dropped managers' threads to end")
    assert [p.name for p in shm_dir.iterdir() if p.name.startswith("kvc.")] == []
    assert len(os.listdir("/proc/self/fd")) <= fds
    with kc.KVCacheManager("after", name="after", **SMALL) as m:
        assert m.backend.ledger._others() == 0  # nothing of theirs is still claimed


# -- item 15: what a reader accepts is bounded ---------------------------------------------------

def test_an_allocator_refuses_more_pages_than_a_segment_holds(shm_dir):
    with pytest.raises(ValueError, match=rf"make {L.MAX_PAGES + 1} pages .* more than a segment's {L.MAX_PAGES}"):
        kc.KVCacheManager("huge", name="huge", num_blocks=L.MAX_PAGES + 1, block_bytes=4096, num_layers=1,
                          page_size=4096)
    assert list(shm_dir.iterdir()) == []


def test_a_header_claiming_more_pages_than_a_segment_holds_is_damaged(spawn_allocator):
    path = dead_segment(spawn_allocator, "forged")
    pages = 4 * L.MAX_PAGES  # 2^22: the old bound (2^24) read this 16 MiB map, and 2^24 took seconds
    forge(path, pages_total=pages, total_bytes=L.total_size(pages, 1))
    with open(path, "r+b") as fh:
        fh.truncate(L.total_size(pages, 1))
    found = kc.scan()
    assert found.models == ()
    assert [(p.status, p.reason) for p in found.problems] == [("corrupt", "implausible sizes in header")]


def test_kvctl_frag_reads_the_largest_segment(shm_dir):
    with kc.KVCacheManager("widest", name="widest", num_blocks=L.MAX_PAGES, block_bytes=4096, num_layers=1,
                           page_size=4096) as m:
        assert m.alloc(64) is not None
        done = kvctl("frag", "widest", "--json")
    assert done.exit_code == 0, done.stderr
    assert '"held_bytes": 524288' in done.stdout  # 64 blocks x 4 KiB x K and V


def test_kvtop_logs_a_model_going_late_and_beating_again() -> None:
    from fakes import fake_model

    from kvtop.frames.events import diff

    on_time = fake_model("m")
    late = replace(on_time, late=True)
    (went,) = diff((on_time,), (late,), 1.0)
    assert (went.kind, went.text) == ("late", "late: pid 4242 runs but its heartbeat stopped (stopped or overloaded)")
    (back,) = diff((late,), (on_time,), 2.0)
    assert (back.kind, back.text) == ("live", "beating again")
    assert late.display_status == "late"


# -- item 13: one poller per process; controllers poke it --------------------------------------

def test_one_poller_thread_serves_every_allocator_of_a_process(shm_dir):
    managers = [kc.KVCacheManager(f"many{i}", name=f"many{i}", **SMALL) for i in range(5)]
    try:
        names = [t.name for t in threading.enumerate() if t.name.startswith("kvc-")]
        assert names.count("kvc-poller") == 1 and not [n for n in names if n.startswith("kvc-watch")]
        for i in range(5):
            assert kc.request_limit(f"many{i}", (i + 1) * managers[i].bundle_bytes, wait=5).status == "applied"
    finally:
        for m in managers:
            m.close()
    wait_for(lambda: "kvc-poller" not in [t.name for t in threading.enumerate()], what="the idle poller to end")


POKED = textwrap.dedent("""
    import sys
    from kvcached_core.allocator import poller
    poller.HEARTBEAT_INTERVAL_S = 3600.0  # no tick but the poke's
    import kvcached_core as kc
    m = kc.KVCacheManager("poked", name="poked", num_blocks=64, block_bytes=1 << 16, num_layers=1,
                          page_size=1 << 18)
    print("READY", flush=True)
    sys.stdin.readline()
    m.close()
""")


def test_a_controller_pokes_the_allocator_instead_of_waiting_for_its_tick(shm_dir):
    child = subprocess.Popen([sys.executable, "-c", POKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=child_env())
    try:
        assert child.stdout.readline() == "READY\n"
        wait_for(lambda: kc.snapshot("poked").applied_revision == 0, what="the segment")
        assert kc.request_limit("poked", 1 << 20, wait=10).status == "applied"
        assert kc.request_trim("poked", wait=10).status == "trimmed"
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_a_request_nobody_poked_is_applied_at_the_next_heartbeat_tick(spawn_allocator, shm_dir):
    spawn_allocator("quiet")
    with open(shm_dir / "kvc.quiet", "r+b") as fh:  # what a controller that does not poke leaves
        fh.seek(L.LIMIT_OFF)
        fh.write(L.I64.pack(1 << 20) + L.U64.pack(1) + L.U64.pack(L.limit_check(1 << 20, 1)))
    snap = wait_for(lambda: (s := kc.snapshot("quiet")).applied_revision == 1 and s, what="the tick")
    assert snap.limit_bytes is not None


# -- item 14: the exporter under many scrapers at once --------------------------------------------

def test_fifty_scrapers_at_once_are_all_answered_and_share_reads(spawn_allocator):
    import urllib.request

    from kvtop.serve.exporter import Exporter

    spawn_allocator("m1")
    bodies: list[bytes] = []
    with Exporter(port=0, with_nvml=False) as exporter:
        assert exporter.backlog >= 50  # socketserver's default of 5 dropped SYNs
        start = threading.Barrier(50)

        def scrape() -> None:
            start.wait()
            with urllib.request.urlopen(exporter.url, timeout=60) as response:
                bodies.append(response.read())

        threads = [threading.Thread(target=scrape) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(bodies) == 50 and all(b"kvcached_model_info{" in b and b'model="m1"' in b for b in bodies)
    assert 1 <= exporter.source.builds <= 50
