"""Hostile hosts: files swapped under a cleaner, names reused, locks held by others, full tmpfs,
other pid namespaces, forged segments. Real processes and real files throughout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import kvctl

import kvcached_core as kc
from kvcached_core.removal import RemovalConflict, inode, remove_verified

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
/* Exchange two names as fast as possible (RENAME_EXCHANGE: neither file is ever lost) until stdin closes. */
int main(int argc, char **argv) {
    long swaps = 0;
    for (;;) {
        for (int i = 0; i < 256; i++)
            if (renameat2(AT_FDCWD, argv[1], AT_FDCWD, argv[2], RENAME_EXCHANGE) == 0) swaps++;
        fd_set in; FD_ZERO(&in); FD_SET(0, &in);
        struct timeval now = {0, 0};
        if (select(1, &in, NULL, NULL, &now) > 0) break;
    }
    printf("%ld\n", swaps);
    return 0;
}
"""


def swapper(tmp_path: Path, a: Path, b: Path) -> subprocess.Popen:
    source = tmp_path / "swap.c"
    source.write_text(SWAPPER_C)
    subprocess.run(["cc", "-O2", "-o", str(tmp_path / "swap"), str(source)], check=True)
    return subprocess.Popen([str(tmp_path / "swap"), str(a), str(b)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_clean_never_deletes_a_file_swapped_in_while_it_works(spawn_allocator, shm_dir, tmp_path):
    """A user's file is exchanged with a stale segment over and over while kvctl clean runs."""
    dead = dead_segment(spawn_allocator, "dead")
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
