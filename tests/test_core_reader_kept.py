"""scan() keeps the files it read open for the next scan: never a leak, never a stale or foreign file.

The reader reads a kept file again only while the directory lists its name with the same inode,
checks its header on every read, and closes what the directory no longer lists.
"""

from __future__ import annotations

import os
import random
import struct
import threading
from pathlib import Path

import pytest

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment import liveness, reader
from kvcached_core.segment.snapshot import MODEL_FIELDS, ModelSnapshot
from kvcached_core.segment.writer import Identity, SegmentWriter


def writer(name: str, directory: Path, pages: int = 16) -> SegmentWriter:
    w = SegmentWriter(Identity(name=name, model=f"m-{name}", engine="test", backend="host", device=0,
                               page_size=1 << 16, block_bytes=1 << 12, num_layers=1, num_kv_buffers=2,
                               blocks_per_page=16, num_blocks=16 * pages, pages_total=pages), directory)
    publish(w, 1)
    return w


def publish(w: SegmentWriter, used: int) -> None:
    w.begin()
    w.set_page(0, L.page_entry(True, used, 0))
    fields = dict.fromkeys(L.COUNTER_FIELDS[:-1], 0)
    fields.update(pages_inuse=1, blocks_used=used, effective_limit=-1, requested_limit=-1, ranks_active=1)
    w.publish(tuple(fields.values()))


def fds() -> list[str]:
    """Where this process's descriptors point."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return found


def segment_fds(directory: Path) -> list[str]:
    """The reader's descriptors on segments of ``directory`` (a writer's mmap holds one on its temporary name)."""
    return [target for target in fds() if target.startswith(f"{directory}/kvc.")]


def test_no_descriptor_leaks_while_segments_come_and_go(shm_dir):
    reader._KEPT.clear()
    baseline = len(fds())
    rng = random.Random(7)
    live: dict[str, SegmentWriter] = {}
    try:
        for step in range(300):
            if live and (len(live) >= 12 or rng.random() < 0.4):
                live.pop(rng.choice(sorted(live))).close()
            else:
                name = f"s{step}"
                live[name] = writer(name, shm_dir)
            found = kc.scan(with_pages=step % 2 == 0)
            assert sorted(m.name for m in found.models) == sorted(live), step
            assert not found.problems, found.problems
            held = segment_fds(shm_dir)
            assert not [t for t in held if t.endswith(" (deleted)")], f"kept a removed file open at step {step}"
            assert len(held) <= len(live)
            assert len(fds()) <= baseline + 2 * len(live), f"descriptors grew at step {step}"  # a writer's mmap holds one
    finally:
        for w in live.values():
            w.close()
    kc.scan()
    assert segment_fds(shm_dir) == [] and len(fds()) <= baseline


def test_the_kept_files_are_bounded_and_another_directory_closes_them(shm_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "MAX_KEPT_OPEN", 3)
    writers = [writer(f"b{i}", shm_dir) for i in range(8)]
    try:
        for _ in range(3):
            assert len(kc.list_models()) == 8
            assert len(segment_fds(shm_dir)) == 3
        other = tmp_path / "other"
        other.mkdir()
        assert kc.scan(directory=other).models == ()
        assert segment_fds(shm_dir) == []
    finally:
        for w in writers:
            w.close()


def test_a_kept_file_written_over_in_place_is_read_as_it_is_now(shm_dir):
    w = writer("inplace", shm_dir)
    try:
        assert [m.name for m in kc.list_models()] == ["inplace"]  # kept open from here
        with open(w.path, "r+b") as fh:  # the public kvctl limit writes its total over the magic
            fh.write(L.I64.pack(1 << 30))
        (problem,) = kc.scan().problems
        assert problem.status == "corrupt" and "header overwritten" in problem.reason and problem.writer_alive
        w.heartbeat()  # the writer puts its header back
        assert [m.name for m in kc.list_models()] == ["inplace"]
        with open(w.path, "r+b") as fh:  # a header that names another segment
            fh.seek(struct.calcsize("<8sIIQQ"))  # where the name starts
            fh.write(b"other\0")
        (problem,) = kc.scan().problems
        assert problem.status == "corrupt" and "names segment 'other'" in problem.reason
    finally:
        w.close()


def test_a_kept_file_cut_short_is_damaged_not_read_past(shm_dir):
    w = writer("cut", shm_dir)
    try:
        assert kc.list_models(with_pages=True)[0].name == "cut"
        os.truncate(w.path, L.PAGE_MAP_OFF + 8)
        for with_pages in (True, False):
            (problem,) = kc.scan(with_pages=with_pages).problems
            assert problem.status == "corrupt" and "shorter than its header says" in problem.reason
    finally:
        w.close(unlink=True)


def test_a_name_given_to_another_file_is_read_from_the_new_file(shm_dir):
    first, second = writer("first", shm_dir), writer("second", shm_dir)
    publish(second, 7)
    try:
        assert [m.name for m in kc.list_models()] == ["first", "second"]
        os.rename(second.path, first.path)  # kvc.first now holds the segment named 'second'
        found = kc.scan()
        assert found.models == ()
        assert [(p.path, "names segment 'second'" in p.reason) for p in found.problems] == [(str(first.path), True)]
        os.unlink(first.path)
        replacement = writer("first", shm_dir)
        publish(replacement, 5)
        (model,) = kc.list_models()
        assert (model.name, model.blocks_used) == ("first", 5)
        replacement.close()
    finally:
        first.close(unlink=False)
        second.close(unlink=False)


def test_one_look_at_a_writer_process_per_scan(shm_dir, monkeypatch):
    writers = [writer(f"p{i}", shm_dir) for i in range(5)]
    asked: list[int] = []

    def counting(pid: int, started: int, uid: int | None = None) -> bool:
        asked.append(pid)
        return True

    monkeypatch.setattr(liveness, "is_alive", counting)
    try:
        assert [m.status for m in kc.list_models()] == ["live"] * 5
        assert asked == [os.getpid()]  # five models of one process: one verdict
    finally:
        for w in writers:
            w.close()


def test_scans_from_several_threads_at_once(shm_dir):
    writers = [writer(f"t{i}", shm_dir) for i in range(6)]
    errors: list[BaseException] = []

    def scans() -> None:
        try:
            for _ in range(200):
                found = kc.scan(with_pages=True)
                assert [m.name for m in found.models] == [f"t{i}" for i in range(6)] and not found.problems
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=scans) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert len(segment_fds(shm_dir)) <= 6
    finally:
        for w in writers:
            w.close()


def test_a_scanned_snapshot_is_the_one_the_constructor_makes(shm_dir):
    w = writer("same", shm_dir)
    try:
        for snap in (kc.list_models(with_pages=True)[0], kc.list_models()[0], kc.snapshot("same")):
            assert set(vars(snap)) == MODEL_FIELDS
            made = ModelSnapshot(**vars(snap))
            assert made == snap and hash(made) == hash(snap) and repr(made) == repr(snap)
    finally:
        w.close()


@pytest.mark.parametrize("changes", [1, 3, 40, 4096])
def test_the_page_sum_of_a_changed_map_is_the_whole_sum(changes):
    from array import array

    rng = random.Random(changes)
    pages = array("I", [rng.randrange(1 << 32) for _ in range(4096 + 5)])
    assert reader.page_sum("sum-test", pages.tobytes(), pages) == sum(pages) & (2**64 - 1)
    for _ in range(5):
        for _ in range(changes):
            pages[rng.randrange(len(pages))] = rng.randrange(1 << 32)
        assert reader.page_sum("sum-test", pages.tobytes(), pages) == sum(pages) & (2**64 - 1)
