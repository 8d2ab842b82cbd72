"""--max-size's deletes over real recordings: a day file goes with its WAL and shared-memory files, but a side
file that is a symbolic link, of another owner, or swapped in after it was checked is never deleted (nor
followed) and is named in one line on stderr."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvcached_core.segment.removal import REMOVING_PREFIX
from kvtop.record.recorder import Recorder
from kvtop.record.retention import SIDECARS, drop_oldest


def _day(out: Path, days_ago: int) -> Path:
    """A real recording of a past day, with the WAL and shared-memory files SQLite had beside it while open."""
    recorder = Recorder(out, gpus=False)
    now = time.time()
    for i in range(3):
        recorder.write(replace(recorder.read(), taken_at=now - days_ago * 86400 + i))
    path = recorder.path
    assert path is not None
    sides = {s: Path(f"{path}{s}").read_bytes() for s in SIDECARS}
    recorder.close()
    for suffix, data in sides.items():
        Path(f"{path}{suffix}").write_bytes(data)
    os.chmod(f"{path}-wal", 0o600)
    os.chmod(f"{path}-shm", 0o600)
    return path


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[tuple[Path, Path, Recorder]]:
    """A directory with one old day file (and its side files) and today's, being written."""
    out = tmp_path / "rec"
    old = _day(out, 2)
    assert Path(f"{old}-wal").stat().st_size > 0  # the commits SQLite kept in its WAL
    today = Recorder(out, gpus=False)
    today.write(today.read())
    yield out, old, today
    today.close()


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_retention_deletes_a_day_file_with_its_wal_and_shm(recording: tuple[Path, Path, Recorder],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, old, today = recording
    assert today.path is not None
    assert drop_oldest(out, 0, keep=today.path) == [old]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(old.name)) == []
    assert today.path.exists()
    assert not [p for p in out.iterdir() if p.name.startswith(REMOVING_PREFIX)]
    assert _stderr_lines(capsys) == []


@pytest.mark.parametrize("suffix", SIDECARS)
def test_a_side_file_that_is_a_symlink_is_neither_followed_nor_deleted(
        recording: tuple[Path, Path, Recorder], tmp_path: Path, suffix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    out, old, today = recording
    target = tmp_path / "outside.bin"  # a regular file of ours on the same file system: following would pass
    target.write_bytes(b"keep me" * 1000)
    side = Path(f"{old}{suffix}")
    side.unlink()
    side.symlink_to(target)
    assert drop_oldest(out, 0, keep=today.path) == [old]  # the day file itself was a verified recording
    assert side.is_symlink() and os.readlink(side) == str(target)
    assert target.read_bytes() == b"keep me" * 1000
    err = _stderr_lines(capsys)
    assert len(err) == 1 and str(side) in err[0] and "symbolic link" in err[0], err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
@pytest.mark.parametrize("suffix", SIDECARS)
def test_a_side_file_of_another_owner_is_not_deleted(recording: tuple[Path, Path, Recorder], suffix: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out, old, today = recording
    side = Path(f"{old}{suffix}")
    before = side.read_bytes()
    os.chown(side, 65534, 65534)
    assert drop_oldest(out, 0, keep=today.path) == [old]
    assert side.read_bytes() == before and side.stat().st_uid == 65534
    err = _stderr_lines(capsys)
    assert len(err) == 1 and str(side) in err[0] and "uid 65534" in err[0], err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
def test_a_recording_of_another_owner_is_not_dropped(recording: tuple[Path, Path, Recorder],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out, old, today = recording
    for path in (old, *(Path(f"{old}{s}") for s in SIDECARS)):
        os.chown(path, 65534, 65534)
    assert drop_oldest(out, 0, keep=today.path) == []
    assert old.exists() and all(Path(f"{old}{s}").exists() for s in SIDECARS)
    assert _stderr_lines(capsys) == []


@pytest.mark.parametrize("kind", ["file", "symlink"])
@pytest.mark.parametrize("suffix", SIDECARS)
def test_a_side_file_swapped_after_its_check_is_not_deleted(
        recording: tuple[Path, Path, Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str,
        kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Once its day file is gone, the first look at the side file's name swaps another file in under it, right
    after that look: whatever checked the name before has checked a file that is no longer there."""
    out, old, today = recording
    side = Path(f"{old}{suffix}")
    target = tmp_path / "outside.bin"
    target.write_bytes(b"keep me")
    intruder = out / "intruder"  # a regular file of ours on the same file system: passes every check but one
    if kind == "file":
        intruder.write_bytes(b"not a side file")
    else:
        intruder.symlink_to(target)
    real_lstat: Callable[..., os.stat_result] = os.lstat
    swapped: list[str] = []

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_lstat(path, *args, **kwargs)
        if not swapped and os.fspath(path) == str(side) and not os.path.exists(old):
            os.replace(intruder, side)
            swapped.append(str(side))
        return result

    monkeypatch.setattr(os, "lstat", lstat)
    assert drop_oldest(out, 0, keep=today.path) == [old]
    monkeypatch.undo()
    assert swapped == [str(side)]
    if kind == "file":
        assert side.read_bytes() == b"not a side file"
    else:
        assert side.is_symlink() and os.readlink(side) == str(target)
    assert target.read_bytes() == b"keep me"
    assert not [p for p in out.iterdir() if p.name.startswith(REMOVING_PREFIX)]
    err = _stderr_lines(capsys)
    assert len(err) == 1 and str(side) in err[0] and "replaced" in err[0], err
