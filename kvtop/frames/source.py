"""Where kvtop's frames come from: live segments and NVML (the tests' deterministic fake is tests/fakes.py).

A :class:`Frame` is everything one refresh shows, frozen: every model's counters, the selected
model's page map (only that one is read in full), the GPUs and the host capacity. The dashboard
asks its source for one frame per refresh from a worker thread and never touches a segment itself.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import kvcached_core as kc
from kvcached_core import GpuInfo, ModelSnapshot, Problem, nvml, read_segment
from kvcached_core.settings import ConfigError, settings, shm_dir_problem


@dataclass(frozen=True)
class Frame:
    """One refresh: what every widget renders."""

    models: tuple[ModelSnapshot, ...]
    problems: tuple[Problem, ...]
    gpus: tuple[GpuInfo, ...]
    gpu_note: str  # why there is no GPU panel ("" when NVML answered)
    host_capacity: int
    detail: ModelSnapshot | None  # the selected model, with its page map
    taken_at: float  # wall-clock seconds
    host: str
    read_s: float = 0.0  # seconds the read took
    directory_problem: str = ""  # why the segment directory cannot be read ("" when it can)
    router: dict[str, dict] = field(default_factory=dict)  # kvctl route's figures by model (kvtop.serve.router.published)

    def model(self, name: str | None) -> ModelSnapshot | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


class Source(Protocol):
    """Reads frames and carries out control requests; every method may block (call from a worker)."""

    def read(self, selected: str | None) -> Frame: ...

    def reread(self, model: ModelSnapshot) -> ModelSnapshot: ...

    def trim(self, model: ModelSnapshot, wait: float) -> kc.Ack: ...

    def compact(self, model: ModelSnapshot, wait: float) -> kc.Ack: ...

    def sleep(self, model: ModelSnapshot, action: str, wait: float) -> kc.Ack: ...

    def limit(self, model: ModelSnapshot, limit_bytes: int | None, wait: float) -> kc.Ack: ...

    def policy(self, model: ModelSnapshot, min_bytes: int | None | object, priority: int | object,
               wait: float) -> kc.Ack: ...

    def close(self) -> None: ...


class LiveSource:
    """The real thing: ``kvcached_core.scan()`` plus one full read of the selected model, and NVML.

    NVML is asked at most every ``nvml_every_s`` seconds: its process queries are the slowest
    part of a refresh on a GPU host, and memory figures that old are still current enough.
    """

    def __init__(self, gpus: Sequence[int] | None = None, *, directory: Path | None = None,
                 nvml_every_s: float = 1.0) -> None:
        self.gpu_filter = list(gpus) if gpus is not None else None
        self.directory = directory
        self.nvml_every_s = nvml_every_s
        self.host = socket.gethostname()
        self._gpus: tuple[GpuInfo, ...] = ()
        self._gpus_at = float("-inf")
        try:
            self._host_capacity = settings().host_capacity_bytes
        except ConfigError:
            self._host_capacity = 0

    def _probe_gpus(self) -> tuple[GpuInfo, ...]:
        now = time.monotonic()
        if now - self._gpus_at >= self.nvml_every_s:
            self._gpus = tuple(nvml.probe(self.gpu_filter))
            self._gpus_at = now
        return self._gpus

    def read(self, selected: str | None) -> Frame:
        started = time.perf_counter()
        found = kc.scan(directory=self.directory)
        detail = None
        for m in found.models:
            if m.name == selected:
                detail = m
                if not m.legacy:
                    try:
                        detail = read_segment(Path(m.path), with_pages=True)
                    except (OSError, ValueError):
                        detail = m  # gone or busy this instant: counters only
                break
        gpus = self._probe_gpus()
        note = "" if gpus or nvml.available() else nvml.unavailable_reason()
        if not gpus and not note:
            note = "NVML reports no GPU" if self.gpu_filter is None else f"no GPU {self.gpu_filter}"
        from kvtop.serve.router.published import read as read_routers

        router = read_routers(self.directory or settings().shm_dir).models
        return Frame(found.models, found.problems, gpus, note, self._host_capacity, detail,
                     time.time(), self.host, time.perf_counter() - started,
                     shm_dir_problem(self.directory) or "", router)

    def reread(self, model: ModelSnapshot) -> ModelSnapshot:
        """The model's counters now (a dialog about to act on it must not show an old frame's figures)."""
        try:
            return kc.snapshot(model.name, with_pages=False, directory=self.directory)
        except (kc.ModelNotFound, OSError, ValueError):
            return model  # gone or busy this instant: what the frame had

    def trim(self, model: ModelSnapshot, wait: float) -> kc.Ack:
        return kc.request_trim(model, wait=wait)

    def compact(self, model: ModelSnapshot, wait: float) -> kc.Ack:
        from kvcached_core.control import request_compact

        return request_compact(model, wait=wait)

    def sleep(self, model: ModelSnapshot, action: str, wait: float) -> kc.Ack:
        """``action``: sleep or wake; returns once the model took it (``draining`` while requests finish)."""
        from kvcached_core.control import request_sleep

        return request_sleep(model, action, wait=wait)

    def limit(self, model: ModelSnapshot, limit_bytes: int | None, wait: float) -> kc.Ack:
        return kc.request_limit(model, limit_bytes, wait=wait)

    def policy(self, model: ModelSnapshot, min_bytes: int | None | object, priority: int | object,
               wait: float) -> kc.Ack:
        """``min_bytes`` and ``priority`` as ``request_policy`` takes them (``KEEP``: as it is)."""
        from kvcached_core.control import request_policy

        return request_policy(model, min_bytes=min_bytes, priority=priority, wait=wait)

    def close(self) -> None:
        pass
