"""Permissions: owner-only segments, no following symlinks, no writing another user's segment, safe names."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvcached_core as kc
from kvcached_core.backends.ledger import LOCK_NAME
from kvcached_core.segment.names import InvalidName
from kvcached_core.segment.writer import SegmentError
from kvtop.cli import main as kvctl_main

OTHER_UID = 4242
SMALL = dict(num_blocks=64, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="only root can chown a file or switch users")


def listing(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.lstat().st_mode, p.lstat().st_uid, p.lstat().st_size) for p in directory.iterdir()}


def as_user(uid: int, fn: Callable[[], object]) -> str:
    """Run ``fn`` in a forked child that dropped to ``uid`` (the interpreter is already loaded, so it needs
    no access to it); returns 'ok: <repr of the result>' or 'ExceptionName: message'."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            message = f"ok: {fn()!r}"
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        out = fh.read().decode()
    os.waitpid(pid, 0)
    return out


def test_segments_and_the_capacity_lock_are_owner_only_even_with_umask_0(shm_dir):
    old = os.umask(0)
    try:
        with kc.KVCacheManager("open", name="open", **SMALL) as m:
            m.alloc(2)
            assert stat.S_IMODE(os.stat(shm_dir / "kvc.open").st_mode) == 0o600
            fd = m.backend.ledger._lock()  # the capacity lock exists only while a claim is made
            try:
                assert stat.S_IMODE(os.stat(shm_dir / LOCK_NAME).st_mode) == 0o600
            finally:
                m.backend.ledger._unlock(fd)
    finally:
        os.umask(old)


@pytest.mark.parametrize("target", ["file", "dangling", "segment"])
def test_a_symlink_in_the_segment_directory_is_refused_for_writing(shm_dir, tmp_path, spawn_allocator, target):
    victim = tmp_path / "precious"
    victim.write_bytes(b"do not touch")
    pointee = {"file": victim, "dangling": tmp_path / "missing", "segment": shm_dir / "kvc.real"}[target]
    if target == "segment":
        spawn_allocator("real")
    os.symlink(pointee, shm_dir / "kvc.evil")
    before = listing(shm_dir)
    with pytest.raises(SegmentError, match=r"'evil' is taken: .*kvc\.evil is a symbolic link; refusing to follow"):
        kc.KVCacheManager("evil", name="evil", **SMALL)
    assert listing(shm_dir) == before and victim.read_bytes() == b"do not touch"
    assert not (tmp_path / "missing").exists()
    assert "evil" not in {m.name for m in kc.list_models()}


@needs_root
def test_another_users_segment_is_never_replaced_or_written(shm_dir, spawn_allocator):
    # A stale segment of another user: a restart under that name must not unlink it.
    dead = spawn_allocator("theirs")
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    os.chown(shm_dir / "kvc.theirs", OTHER_UID, OTHER_UID)
    before = listing(shm_dir)
    with pytest.raises(SegmentError, match=rf"'theirs' is taken: .* belongs to uid {OTHER_UID}, not you \(uid 0\)"):
        kc.KVCacheManager("theirs", name="theirs", **SMALL)
    assert listing(shm_dir) == before

    # A live segment that another user owns: controls are refused, nothing is written.
    spawn_allocator("shared")
    path = shm_dir / "kvc.shared"
    os.chown(path, OTHER_UID, OTHER_UID)
    control = path.read_bytes()[512:576]
    with pytest.raises(kc.ControlError, match=rf"kvc\.shared belongs to uid {OTHER_UID}, not you .* refusing to write"):
        kc.request_limit("shared", 1 << 20)
    with pytest.raises(kc.ControlError, match=rf"kvc\.shared belongs to uid {OTHER_UID}"):
        kc.request_trim("shared")
    assert path.read_bytes()[512:576] == control


def test_a_segment_readable_by_others_is_not_trusted_for_control(shm_dir, spawn_allocator):
    spawn_allocator("loose")
    path = shm_dir / "kvc.loose"
    os.chmod(path, 0o644)
    with pytest.raises(kc.ControlError, match=r"kvc\.loose is readable by others \(mode 644\); refusing to trust it"):
        kc.request_limit("loose", 1 << 20)
    os.chmod(path, 0o600)
    assert kc.request_limit("loose", 1 << 20, wait=5).status == "applied"


@needs_root
def test_a_control_request_from_another_user_is_refused(shm_dir, spawn_allocator):
    """A real second user: it cannot open the owner-only segment, so nothing is written and it says why."""
    proc = spawn_allocator("mine")
    os.chmod(shm_dir, 0o755)  # let the other user list the directory (the files stay 0600)
    path = shm_dir / "kvc.mine"
    control = path.read_bytes()[512:576]
    snap = kc.snapshot("mine")

    assert as_user(65534, lambda: kc.request_limit(snap, 1 << 20)).startswith(
        "ControlError: cannot open kvc.mine for writing: Permission denied")
    assert as_user(65534, lambda: kc.request_trim(snap)).startswith(
        "ControlError: cannot open kvc.mine for writing: Permission denied")
    assert as_user(65534, lambda: kc.request_limit("mine", 1 << 20)).startswith("ModelNotFound: no model named 'mine'")
    seen = as_user(65534, lambda: [(p.status, p.reason) for p in kc.scan().problems])
    assert seen.startswith("ok: [('unreadable', ") and "Permission denied" in seen
    assert path.read_bytes()[512:576] == control

    def kvctl_limit() -> tuple[int, str, str]:
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = kvctl_main.run(["limit", "mine", "1MiB"], "kvctl", None)
        return int(code), err.getvalue(), out.getvalue()

    result = as_user(65534, kvctl_limit)
    assert result.startswith("ok: "), result
    code, err, out = ast.literal_eval(result[4:])
    assert code == 1 and out == ""
    assert err.startswith("kvctl: 'mine' is not a usable segment: ") and "Permission denied" in err
    assert len(err.splitlines()) == 1
    assert proc.poll() is None and kc.snapshot("mine").limit_revision == 0


BAD_NAMES = ["../evil", "a/b", "/abs", "..", ".", "has space", "semi;colon", "new\nline", "nul\0byte",
             "ünïcode", "x" * 65, "kvc.dot", "$(reboot)", "tab\t"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_odd_segment_names_are_refused_with_a_clear_message(shm_dir, name, monkeypatch):
    before = listing(shm_dir)
    with pytest.raises(InvalidName, match=r"invalid segment name .*: use 1-64 characters from A-Z a-z 0-9 _ -"):
        kc.KVCacheManager("model", name=name, **SMALL)
    if "\0" not in name:  # the environment cannot hold NUL
        monkeypatch.setenv("KVCACHED_IPC_NAME", name)
        with pytest.raises(InvalidName, match="invalid segment name"):
            kc.KVCacheManager("model", **SMALL)
    assert listing(shm_dir) == before
    assert not Path("/dev/shm/evil").exists() and not (shm_dir.parent / "evil").exists()


@pytest.mark.parametrize(("model", "segment"), [
    ("meta-llama/Llama-3-8B", "meta-llama_Llama-3-8B"), ("../../etc/passwd", "etc_passwd"), ("..", "model"),
    ("Qwen 2.5 (72B)", "Qwen_2_5_72B"), ("x" * 100, "x" * 64),
])
def test_model_names_become_safe_segment_names(shm_dir, model, segment):
    with kc.KVCacheManager(model, **SMALL) as m:
        assert m.name == segment
        assert sorted(p.name for p in shm_dir.iterdir() if p.name.startswith("kvc.")) == [f"kvc.{segment}"]
        (found,) = kc.list_models()
        assert (found.name, found.model) == (segment, model)


def test_a_stale_segment_of_ours_is_replaced_only_when_its_process_is_gone(shm_dir, spawn_allocator):
    first = spawn_allocator("cycle")
    os.kill(first.pid, signal.SIGSTOP)  # frozen, not dead: its heartbeat goes late, the name stays taken
    try:
        deadline = time.monotonic() + 10
        while not kc.list_models()[0].late:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(SegmentError, match=rf"in use by a live allocator \(pid {first.pid}\)"):
            kc.KVCacheManager("cycle", name="cycle", **SMALL)
    finally:
        os.kill(first.pid, signal.SIGCONT)
