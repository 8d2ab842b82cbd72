"""kvctl record and its reader over a real demo fleet: what is read back equals what was live, byte for byte; bad
files (not a recording, a newer schema, cut short, forged, a full disk, a killed recorder) answer one line and
delete nothing; --max-size drops only the oldest recording."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import wait_for

import kvcached_core as kc
from kvcached_core import ModelSnapshot
from kvtop.demo.fleet import DemoFleet
from kvtop.frames.source import Frame
from kvtop.record import reading
from kvtop.record.reading import Recording, RecordingError
from kvtop.record.recorder import Recorder
from kvtop.record.retention import drop_oldest, recording_size
from kvtop.record.schema import PAGE_SIZE

KVCTL = [sys.executable, "-m", "kvtop.cli"]


@pytest.fixture
def fleet() -> Iterator[DemoFleet]:
    demo = DemoFleet(3, seed=7)
    with demo:
        assert demo.wait_ready(30), demo.failure
        yield demo


def _live(name: str) -> ModelSnapshot:
    return kc.snapshot(name, with_pages=True)


def test_snapshot_record_round_trip(fleet: DemoFleet) -> None:
    for m in kc.scan(with_pages=True).models:
        record = json.loads(json.dumps(m.to_record()))  # through JSON, as stored
        back = ModelSnapshot.from_record(record, m.pages)
        assert back == m and back.pages == m.pages
        assert back.to_dict() == m.to_dict()
        assert back.pressure is not None and back.sleep is not None and back.compaction is not None


def _record(recorder: Recorder, kept: list[tuple[float, Frame]]) -> None:
    frame = recorder.read()
    kept.append((recorder.write(frame), frame))


def test_replayed_moments_equal_the_live_ones(fleet: DemoFleet, tmp_path: Path) -> None:
    names = fleet.names()
    recorder = Recorder(tmp_path, gpus=False, key_every=4)  # key samples often: deltas across keys are exercised
    kept: list[tuple[float, Frame]] = []
    for _ in range(3):
        _record(recorder, kept)
    limited = _live(names[0])
    kc.request_limit(limited, limited.bundle_bytes, wait=10.0)  # below what it holds: deferred
    _record(recorder, kept)
    kc.request_trim(_live(names[1]), wait=10.0)
    _record(recorder, kept)
    from kvcached_core.control import request_sleep

    request_sleep(_live(names[2]), "sleep", wait=10.0, until_done=True)
    for _ in range(8):
        _record(recorder, kept)
        time.sleep(0.05)
    recorder.close()

    with Recording.open(tmp_path) as rec:
        assert rec.problems == []
        assert list(rec.times()) == [t for t, _ in kept]
        assert (rec.start, rec.end) == (kept[0][0], kept[-1][0])
        assert rec.models() == sorted(names)
        for t, frame in kept:
            for live in frame.models:
                shown = rec.frame_at(t, live.name)
                assert shown.taken_at == t
                assert shown.models == frame.models
                assert shown.detail == live
                assert shown.detail is not None and live.pages is not None
                assert shown.detail.pages is not None
                assert shown.detail.pages.tobytes() == live.pages.tobytes()  # byte for byte
        kinds = {e.kind for e in rec.events(rec.start, rec.end)}
        assert {reading.START, reading.TRIM, reading.SLEEP} <= kinds
        assert kinds & {reading.LIMIT_DEFERRED, reading.LIMIT_APPLIED}
        first_sleep = rec.next_event_after(rec.start, [reading.SLEEP])
        assert first_sleep is not None and first_sleep.model == names[2]
        samples = list(rec.samples_of(names[0], rec.start, rec.end))
        assert [s for _, s in samples] == [f.model(names[0]) for _, f in kept]
        assert all(s.pages is None for _, s in samples)
        every = list(rec.samples(rec.start, rec.end))  # every model of a sample at once, as report reads
        assert [t for t, _ in every] == [t for t, _ in kept]
        assert [list(models.values()) for _, models in every] == [list(f.models) for _, f in kept]
        assert [t for t, _ in rec.samples(kept[2][0], kept[4][0], {names[1]})] == [t for t, _ in kept[2:5]]


def _samples(path: Path) -> int:
    try:
        with Recording.open(path) as rec:
            return len(rec.times())
    except RecordingError:
        return 0


def _start_recorder(procs, out: Path, *extra: str, **kwargs):
    return procs.start([*KVCTL, "record", "--out", str(out), "--interval", "0.05", "--no-gpus", *extra],
                       stdout=kwargs.pop("stdout", None), stderr=kwargs.pop("stderr", None), **kwargs)


def test_kvctl_record_stops_cleanly_and_survives_sigkill(fleet: DemoFleet, tmp_path: Path, procs) -> None:
    out = tmp_path / "rec"
    proc = _start_recorder(procs, out)
    wait_for(lambda: _samples(out) >= 5, 30, "five samples")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    clean = _samples(out)
    assert not Path(f"{next(out.iterdir())}-wal").exists() or Path(f"{next(out.iterdir())}-wal").stat().st_size == 0

    proc = _start_recorder(procs, out)
    wait_for(lambda: _samples(out) >= clean + 20, 30, "more samples")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0

    proc = _start_recorder(procs, out)
    before = _samples(out)
    wait_for(lambda: _samples(out) >= before + 20, 30, "more samples")
    proc.send_signal(signal.SIGKILL)  # mid-write, very likely: it writes all the time
    proc.wait(30)
    with Recording.open(out) as rec:  # the committed samples, every one readable
        assert len(rec.times()) >= before + 20
        for t in rec.times()[-5:]:
            shown = rec.frame_at(t, fleet.names()[0])
            assert shown.detail is not None and shown.detail.pages is not None
        assert rec.problems == []


def _one_recording(tmp_path: Path, fleet_names: list[str], samples: int = 10) -> Path:
    recorder = Recorder(tmp_path / "one", gpus=False, key_every=4)
    for _ in range(samples):
        recorder.write(recorder.read())
    recorder.close()
    assert recorder.path is not None
    return recorder.path


def test_a_file_cut_short_reads_its_readable_part(fleet: DemoFleet, tmp_path: Path) -> None:
    path = _one_recording(tmp_path, fleet.names(), samples=200)
    cut = tmp_path / "cut.sqlite"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    try:
        rec = Recording.open(cut)
    except RecordingError as exc:  # the cut took a page every read needs: one line
        assert "\n" not in str(exc) and str(cut) in str(exc)
    else:
        with rec:
            assert rec.problems, "a file cut short is reported"
            assert all("\n" not in p for p in rec.problems)
            rec.frame_at(rec.start, fleet.names()[0])  # its first moment reads
    assert cut.stat().st_size == len(data) * 2 // 3  # nothing written, nothing deleted


def test_not_a_recording_newer_schema_and_forged_rows(fleet: DemoFleet, tmp_path: Path) -> None:
    text = tmp_path / "notes.sqlite"
    text.write_text("not a database at all\n" * 100)
    with pytest.raises(RecordingError, match="not a recording") as info:
        Recording.open(text)
    assert "\n" not in str(info.value)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(RecordingError, match="not a recording"):
        Recording.open(other)

    path = _one_recording(tmp_path, fleet.names(), samples=12)
    newer = tmp_path / "newer.sqlite"
    shutil.copy(path, newer)
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(RecordingError, match="newer") as info:
        Recording.open(newer)
    assert "schema 99" in str(info.value)

    forged = tmp_path / "forged.sqlite"
    shutil.copy(path, forged)
    with sqlite3.connect(forged) as db:
        payload = db.execute("SELECT payload FROM samples WHERE seq = 6").fetchone()[0]
        db.execute("UPDATE samples SET payload = ? WHERE seq = 6", (payload[:-1] + b"!",))  # its CRC fails
        db.execute("UPDATE events SET text = 'forged' WHERE id = 1")
    with Recording.open(forged) as rec:
        times = rec.times()
        shown = rec.frame_at(times[6], fleet.names()[0])
        assert shown.taken_at == times[5]  # the damaged sample reads as absent: the moment before it
        assert rec.frame_at(times[8], None).taken_at == times[8]  # from the next key sample on, as recorded
        assert rec.events(rec.start, rec.end) == []
        assert len(rec.problems) == 2 and all("damaged" in p for p in rec.problems)
    assert forged.exists() and newer.exists() and text.exists()

    torn = tmp_path / "torn.sqlite"  # a time that is no number, as a file overwritten or cut short shows
    shutil.copy(path, torn)
    with sqlite3.connect(torn) as db:
        db.execute("UPDATE samples SET t = 'x' WHERE seq = 10")
    with Recording.open(torn) as rec:
        assert len(rec.times()) == 11
        [line] = rec.problems
        assert "sample 10 is damaged" in line and "cut short" in line and "out of order" not in line


def test_a_full_disk_is_one_line_and_leaves_a_readable_file(fleet: DemoFleet, tmp_path: Path, procs) -> None:
    out = tmp_path / "rec"
    limit = 24 * PAGE_SIZE  # the tables and a few samples: the write that crosses it fails

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _start_recorder(procs, out, stderr=-1, preexec=small_files)
    assert proc.wait(60) == 1
    err = proc.stderr.read().decode()
    assert len(err.strip().splitlines()) == 2, err  # its start line, then one line saying why
    assert "cannot write" in err.splitlines()[-1] and "Traceback" not in err
    with Recording.open(out) as rec:
        assert len(rec.times()) >= 1
        rec.frame_at(rec.end, fleet.names()[0])


def test_kvctl_record_refuses_a_forged_day_file_and_deletes_nothing(tmp_path: Path, procs) -> None:
    out = tmp_path / "rec"
    out.mkdir()
    from kvtop.record.schema import day_path

    forged = day_path(out, time.time())
    forged.write_bytes(b"x" * 4096)
    proc = _start_recorder(procs, out, "--duration", "1", stderr=-1)
    assert proc.wait(30) == 1
    err = proc.stderr.read().decode().strip().splitlines()
    assert len(err) == 2 and str(forged) in err[-1]
    assert forged.read_bytes() == b"x" * 4096


def test_max_size_drops_the_oldest_day_file_only(fleet: DemoFleet, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    now = time.time()
    for days_ago in (3, 2, 1):
        recorder = Recorder(out, gpus=False)
        for i in range(5):
            recorder.write(replace(recorder.read(), taken_at=now - days_ago * 86400 + i))
        recorder.close()
    not_ours = out / "kvrecord-2000-01-01.sqlite"  # named like a day file, but no recording
    not_ours.write_bytes(b"y" * 100_000)
    files = sorted(p.name for p in out.glob("kvrecord-2*.sqlite") if p != not_ours)
    total = sum(recording_size(out / n) for n in files) + not_ours.stat().st_size
    recorder = Recorder(out, gpus=False)  # today's file, being written
    recorder.write(recorder.read())
    assert recorder.path is not None
    today = recorder.path
    total += recording_size(today)
    dropped = drop_oldest(out, total - 1, keep=today)  # one file too many
    recorder.close()
    assert dropped == [out / files[0]]  # the oldest recording, not the file named like one
    left = sorted(p.name for p in out.iterdir() if not p.name.endswith(("-wal", "-shm")))
    assert left == sorted([not_ours.name, *files[1:], today.name])
    assert not_ours.read_bytes() == b"y" * 100_000
    assert drop_oldest(out, 0, keep=today) == [out / n for n in files[1:]]  # never today's, never not_ours
