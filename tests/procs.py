"""Child processes for tests: started as from a fresh terminal, ended whatever the test's outcome.

A test run inherits what started it: a background job of a POSIX shell (``cmd &``, ``nohup``, many CI
runners) has SIGINT and SIGQUIT ignored, a service may block signals, and a terminal or tmux pane gives a
controlling terminal and a process group that a Ctrl-C there reaches. A child inherits all of it, so a test
that sends Ctrl-C to ``kvctl watch`` would wait for an exit that never comes. ``start`` gives a child the
default dispositions and its own session (so its own process group, no controlling terminal);
``Processes.end_all`` ends each child's whole group at teardown: SIGTERM first so that a demo removes its
segments, SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

RESET = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP)  # subprocess restores SIGPIPE itself
GRACE_S = 10.0


def default_signals() -> None:
    """``preexec_fn``: SIGINT, SIGQUIT, SIGTERM and SIGHUP at their default dispositions, no signal blocked."""
    for sig in RESET:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def start(command: Sequence[str], *, preexec: Callable[[], None] | None = None, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(command, **kwargs)`` with default signal dispositions, in a new session (unless
    ``start_new_session=False``); ``preexec`` runs after the reset, in the child."""

    def prepare() -> None:
        default_signals()
        if preexec is not None:
            preexec()

    kwargs.setdefault("start_new_session", True)
    return subprocess.Popen(command, preexec_fn=prepare, **kwargs)


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` that still run (zombies left out: they hold nothing)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_group(pgid: int, grace: float = GRACE_S, leader: subprocess.Popen | None = None) -> None:
    """End process group ``pgid``: SIGTERM (time to clean up), SIGKILL to what still runs after ``grace``
    seconds. ``leader``: our Popen of the group's leader, reaped as it goes (or it would count as running)."""

    def running() -> bool:
        if leader is not None:
            leader.poll()
        return bool(group_members(pgid))

    if not running():
        return
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if running():
        _signal_group(pgid, signal.SIGKILL)


def end(proc: subprocess.Popen, grace: float = GRACE_S, group: bool = True) -> None:
    """End ``proc`` (and, with ``group``, every process of its group: it must lead one, as ``start`` makes
    it): SIGTERM, then SIGKILL to what still runs after ``grace`` seconds; reap ``proc``, close its pipes."""
    if group:
        end_group(proc.pid, grace, leader=proc)
    elif proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


class Processes:
    """The children one test started; ``end_all`` ends every one of them (the ``procs`` fixture calls it)."""

    def __init__(self) -> None:
        self.started: list[tuple[subprocess.Popen, bool]] = []

    def start(self, command: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        proc = start(command, **kwargs)
        self.started.append((proc, kwargs.get("start_new_session", True)))
        return proc

    def end_all(self) -> None:
        for proc, group in reversed(self.started):
            end(proc, group=group)
        self.started.clear()
