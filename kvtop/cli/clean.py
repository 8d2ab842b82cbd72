"""``kvctl clean``: remove your own segments whose processes are gone."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import click

from kvcached_core import ModelSnapshot
from kvcached_core.interop.legacy import dead_segment
from kvcached_core.segment import layout as L
from kvcached_core.segment.liveness import heartbeat_late, removable
from kvcached_core.segment.procinfo import is_alive
from kvcached_core.segment.reader import parse_header
from kvcached_core.segment.removal import inode, remove_verified
from kvcached_core.segment.writer import temp_owner
from kvcached_core.settings import settings
from kvtop import textfmt as T
from kvtop.cli import ExitCode
from kvtop.cli.common import read, warn


def _still_dead(m: ModelSnapshot) -> os.stat_result | None:
    """The file's stat when the file now at ``m.path`` is still our segment of that same dead process."""
    try:
        fd = os.open(m.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return st if _dead_segment(m)(fd) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _dead_segment(m: ModelSnapshot) -> Callable[[int], bool]:
    """Whether an open file is still the segment of ``m``'s process (not a newer one's), and that writer is gone."""
    def check(fd: int) -> bool:
        body = os.pread(fd, L.PAGE_MAP_OFF, 0)
        header = parse_header(body)
        if (header["pid"], header["start_time"]) != (m.pid, m.start_time):
            return False  # replaced by a newer process since we listed it
        return removable(header, body)
    return check


def _dead_creator(pid: int) -> Callable[[int], bool]:
    return lambda fd: os.fstat(fd).st_uid == os.getuid() and not is_alive(pid, 0)


def _dead_owned_files(owner: Callable[[str], int | None]) -> list[tuple[str, int, os.stat_result]]:
    """Regular files of ours in the segment directory whose owning process (``owner`` reads its pid from the
    file name; None: not such a file) is gone."""
    directory = settings().shm_dir
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for filename in names:
        pid = owner(filename)
        if pid is None or is_alive(pid, 0):
            continue
        path = str(directory / filename)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            found.append((path, pid, st))
    return found


def _leftovers() -> list[tuple[str, int, os.stat_result]]:
    """Half-created segments (a creator killed between creating and naming the file): ours, its pid gone."""
    return _dead_owned_files(temp_owner)


def _router_pid(filename: str) -> int | None:
    from kvtop.router.published import PREFIX

    pid_text = filename[len(PREFIX):].removesuffix(".tmp") if filename.startswith(PREFIX) else ""
    return int(pid_text) if pid_text.isdigit() else None


def _router_leftovers() -> list[tuple[str, int, os.stat_result]]:
    """Figure files of kvctl route processes that were killed (one that stops removes its own): ours, pid gone."""
    return _dead_owned_files(_router_pid)


@click.command("clean")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
def clean_cmd(dry_run: bool) -> None:
    """Remove stale segments of dead processes that belong to you, and say what was removed.

    Also removes your half-created segments, the hidden file an allocator builds before naming
    it, left behind when that process was killed mid-creation:

    \b
      .kvc-new.<name>.<pid>

    Also removes the figure files of your kvctl route processes that were killed (one that
    stops removes its own):

    \b
      .kvroute.<pid>

    Also removes your upstream kvcached segments (``kvcached_<engine>_<pgid>``) whose process
    group is gone or was reused after the file was last written.

    Never touches a live segment, a segment whose process still runs (even with a late
    heartbeat), a segment whose heartbeat is fresh (its process just ended: clean again later), another user's segment (one warning line each), an upstream segment whose
    name carries no process group (``KVCACHED_IPC_NAME``) or whose group may live in another
    pid namespace, or any file that is not a valid segment. Exit 0 also when there is
    nothing to clean.

    \b
    Examples:
      kvctl clean --dry-run
      kvctl clean
    """
    doomed: list[tuple[str, str, os.stat_result, Callable[[int], bool]]] = []  # + its re-check
    for m in read().models:
        if m.status != "stale":
            if m.late and m.uid == os.getuid():
                warn(f"kept {m.path}: process {m.pid} still runs (its heartbeat is late)")
            continue
        try:
            owner = os.lstat(m.path).st_uid
        except FileNotFoundError:
            continue  # went away on its own
        if owner != os.getuid():
            warn(f"kept {m.path}: it belongs to uid {owner}, not you")
            continue
        if m.legacy:
            dead = dead_segment(Path(m.path))
            if dead is not None:
                doomed.append((m.path, f"upstream kvcached segment, process group {m.pid} gone", *dead))
            continue
        if not heartbeat_late(m.heartbeat_ns, m.read_ns):
            warn(f"kept {m.path}: process {m.pid} is gone but its heartbeat is fresh; "
                 "run kvctl clean again in a few seconds")
            continue
        checked = _still_dead(m)
        if checked is None:
            continue
        doomed.append((m.path, f"model {m.model}, pid {m.pid}", checked, _dead_segment(m)))
    doomed += [(path, f"a segment pid {pid} never finished creating", st, _dead_creator(pid))
               for path, pid, st in _leftovers()]
    doomed += [(path, f"kvctl route figures, pid {pid} gone", st, _dead_creator(pid))
               for path, pid, st in _router_leftovers()]
    failed = False
    acted = 0
    for path, detail, checked, recheck in doomed:
        what = f"{path} ({detail}, {T.fmt_bytes(checked.st_size)})"
        acted += 1
        if dry_run:
            click.echo(f"would remove {what}")
            continue
        try:
            if not remove_verified(path, inode(checked), recheck):
                continue  # replaced meanwhile: not ours to remove any more (left as it was)
        except OSError as exc:
            failed = True
            click.echo(f"kvctl: cannot remove {path}: {exc.strerror}", err=True)
            continue
        click.echo(f"removed {what}")
    if not acted:
        click.echo("nothing to clean")
    if failed:
        raise click.exceptions.Exit(ExitCode.FAILURE)
