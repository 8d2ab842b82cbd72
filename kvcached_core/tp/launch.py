"""Start rank workers as child processes and hand them to a scheduler."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..backends import BackendError
from .broadcast import BroadcastBackend, reap

START_TIMEOUT_S = 60.0
_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout holding kvcached_core


@dataclass
class WorkerGroup:
    """Worker processes (one per rank) listening in a private socket directory."""

    paths: list[str]
    processes: list[subprocess.Popen]
    directory: str
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        """Wait for workers told to close (kill those that do not), then remove the socket directory."""
        if self._stopped:
            return
        self._stopped = True
        for proc in self.processes:
            reap(proc)
        shutil.rmtree(self.directory, ignore_errors=True)

    def kill(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
        self.stop()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    if _ROOT not in path.split(os.pathsep):
        env["PYTHONPATH"] = _ROOT + (os.pathsep + path if path else "")
    return env


def spawn_workers(world: int, *, backend: str = "host", devices: Sequence[int] | None = None,
                  capacity: int | Sequence[int | None] | None = None, label: str = "model",
                  start_timeout: float = START_TIMEOUT_S) -> WorkerGroup:
    """Start ``world`` workers (``python -m kvcached_core.tp.worker``) and wait until each listens.

    ``devices`` defaults to GPU ``rank`` for cuda and 0 elsewhere; ``capacity`` caps each host or
    null rank (one value for all, or one per rank). The geometry comes from the scheduler.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    devices = list(devices) if devices is not None else [r if backend == "cuda" else 0 for r in range(world)]
    if len(devices) != world:
        raise ValueError(f"{len(devices)} devices for {world} ranks")
    caps = list(capacity) if isinstance(capacity, (list, tuple)) else [capacity] * world
    if len(caps) != world:
        raise ValueError(f"{len(caps)} capacities for {world} ranks")
    directory = tempfile.mkdtemp(prefix="kvc-tp-")
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:40] or "model"
    paths = [os.path.join(directory, f"{safe}.rank{r}.sock") for r in range(world)]
    procs: list[subprocess.Popen] = []
    group = WorkerGroup(paths, procs, directory)
    try:
        for rank, (path, device, cap) in enumerate(zip(paths, devices, caps, strict=True)):
            cmd = [sys.executable, "-m", "kvcached_core.tp.worker", "--socket", path, "--rank", str(rank),
                   "--device", str(device), "--backend", backend]
            if cap is not None:
                cmd += ["--capacity", f"{cap}B"]  # bytes: a size without a unit is refused
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          env=_child_env(), text=True))
        deadline = time.monotonic() + start_timeout
        for rank, proc in enumerate(procs):
            _wait_ready(proc, rank, deadline)
    except BaseException:
        group.kill()
        raise
    return group


def _wait_ready(proc: subprocess.Popen, rank: int, deadline: float) -> None:
    assert proc.stdout is not None
    remaining = deadline - time.monotonic()
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("READY"):
        code = proc.poll()
        why = f"exited with status {code}" if code is not None else "did not start in time"
        raise BackendError(f"tensor-parallel worker for rank {rank} {why}")
    proc.stdout.close()


def attach(geometry, backend: str, group: WorkerGroup, **kwargs) -> BroadcastBackend:
    """A bare :class:`BroadcastBackend` over ``group`` (no manager, no segment): for benchmarks and tools."""
    try:
        bb = BroadcastBackend(geometry, backend, group.paths, **kwargs)
    except BaseException:
        group.kill()
        raise
    adopt(bb, group)
    return bb


def adopt(bb: BroadcastBackend, group: WorkerGroup) -> None:
    """Make ``bb.close()`` also stop the group's processes (kept as ``bb.workers``)."""
    bb.workers = group
    bb.owned.append(group.stop)
