"""The models the router serves, from their segments: rescanned, so engines come and go without a restart.

A model is routable when its segment publishes an endpoint (the ENDPOINT words). It answers to the
names its engine's ``/v1/models`` lists (vLLM's ``--served-model-name``), to its segment's name and to
the model its header names (when no other engine claims it). A model whose engine is gone (its process
exited: the segment is stale, or the segment was removed) stays known as gone, so a request for it is
told why (503) instead of that the model never existed (404). A model whose segment is there but cannot
be routed (it publishes no endpoint, or its file is not this user's own) is known as skipped, with why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvcached_core import ModelSnapshot, scan

LIVE, ASLEEP, DRAINING, GONE = "live", "asleep", "draining", "gone"
SERVED_TIMEOUT_S = 5.0  # an engine's /v1/models, asked once per engine process
NO_ENDPOINT = "publishes no serving address (its engine serves no HTTP endpoint)"
NOT_OWN = ("its segment is not a private file of this user (requests go only to engines whose segments this "
           "user owns: another's could name any address)")


@dataclass(frozen=True)
class Skipped:
    """A model kvctl list shows that the router cannot send requests to, and why."""

    name: str  # the segment's name
    model: str  # the model its header names
    why: str


def _scan_own(shm_dir: Path | None) -> tuple[list[tuple[ModelSnapshot, str]], list[Skipped], set[str]]:
    """The models that publish an endpoint in segment files this user owns (0600, as allocators create them): a
    segment another user wrote could name any address, and requests carry prompts. The live models that cannot
    be routed, with why. And the names of segments too busy to read this instant (their writer stayed inside a
    publish through the reader's retries)."""
    found = scan(directory=shm_dir, ours_only=True)
    busy = {name for p in found.problems if p.status == "busy" and (name := p.segment_name) is not None}
    own = []
    skipped = []
    for snap in found.models:
        endpoint = snap.endpoint
        if endpoint is None:  # upstream (legacy) rows publish none either
            if snap.status != "stale":
                skipped.append(Skipped(snap.name, snap.model, NO_ENDPOINT))
            continue  # nothing to send requests to
        try:
            st = os.stat(snap.path, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            own.append((snap, endpoint))
        elif snap.status != "stale":
            skipped.append(Skipped(snap.name, snap.model, NOT_OWN))
    return own, skipped, busy


def state_of(snap: ModelSnapshot) -> str:
    """live, asleep, draining, or gone (its process exited); a late or shrinking model is live."""
    if snap.status != "live":
        return GONE
    if snap.sleep is not None and snap.sleep.state in (ASLEEP, DRAINING):
        return snap.sleep.state
    return LIVE


@dataclass
class Engine:
    """One model's engine, as its segment last said."""

    name: str  # the segment's name
    endpoint: str
    snap: ModelSnapshot
    state: str
    served: tuple[str, ...] = ()  # the ids its /v1/models lists; () until asked
    gone_reason: str = ""
    seen: int = 0  # when the router first saw this engine process (Unix seconds): /v1/models' ``created``

    @property
    def key(self) -> tuple[str, int, int, str]:
        """One engine process: its served names are asked once per key."""
        return self.name, self.snap.pid, self.snap.start_time, self.endpoint

    @property
    def priority(self) -> int:
        """The model's memory-policy priority (``kvctl policy --priority``; 0 when it publishes none)."""
        return self.snap.pressure.priority if self.snap.pressure is not None else 0

    @property
    def model_id(self) -> str:
        """The id the engine serves (the first its /v1/models lists), else its segment's name."""
        return self.served[0] if self.served else self.name


@dataclass
class Directory:
    """The engines behind the router, found in ``shm_dir`` (None: KVCACHED_SHM_DIR)."""

    shm_dir: Path | None
    session: aiohttp.ClientSession | None = None
    engines: dict[str, Engine] = field(default_factory=dict)  # by segment name, gone ones included
    skipped: list[Skipped] = field(default_factory=list)  # as of the last scan, by name
    scans: int = 0
    _names: dict[str, str] = field(default_factory=dict)  # a name a request may give -> segment name
    _served: dict[tuple, tuple[str, ...]] = field(default_factory=dict)
    _asking: dict[tuple, asyncio.Task] = field(default_factory=dict)
    _last_scan: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def refresh(self, unless_since: float | None = None) -> None:
        """Scan the segment directory again (in a thread: the reads are files) and rebuild the names; with
        ``unless_since`` (a monotonic time), not when a scan started since then (callers waiting together share one)."""
        async with self._lock:
            if unless_since is not None and self._last_scan >= unless_since:
                return
            self._last_scan = time.monotonic()
            found, skipped, busy = await asyncio.to_thread(_scan_own, self.shm_dir)
            self.scans += 1
            self.skipped = sorted(skipped, key=lambda s: s.name)
            seen = set()
            for snap, endpoint in found:
                seen.add(snap.name)
                engine = Engine(snap.name, endpoint, snap, state_of(snap))
                if engine.state == GONE:
                    engine.gone_reason = f"its engine (pid {snap.pid}) has exited"
                engine.served = self._served.get(engine.key, ())
                before = self.engines.get(snap.name)
                engine.seen = before.seen if before is not None and before.key == engine.key else int(time.time())
                if not engine.served and engine.state != GONE:
                    self._ask_served(engine)
                self.engines[snap.name] = engine
            for name, engine in self.engines.items():
                # A segment too busy to read this instant is still there: its engine stays as last seen, not gone
                # (its requests would be answered 503 'its segment was removed').
                if name not in seen and name not in busy and engine.state != GONE:
                    engine.state, engine.gone_reason = GONE, "its segment was removed (the engine stopped) or is no longer private to this user"
            current = {e.key for e in self.engines.values()}
            self._served = {key: ids for key, ids in self._served.items() if key in current}  # engines restarted
            self._rename()

    def _rename(self) -> None:
        names: dict[str, str] = {}
        ranked = sorted(self.engines.values(), key=lambda e: (e.state == GONE, e.name))  # live ones claim first
        for engine in ranked:
            for served in engine.served:
                names.setdefault(served, engine.name)
        for engine in ranked:
            names.setdefault(engine.name, engine.name)
        for engine in ranked:
            names.setdefault(engine.snap.model, engine.name)
        self._names = names

    def _ask_served(self, engine: Engine) -> None:
        key = engine.key
        if self.session is None or key in self._asking:
            return
        task = asyncio.get_running_loop().create_task(self._served_ids(engine))
        self._asking[key] = task
        task.add_done_callback(lambda _t: self._asking.pop(key, None))

    async def _served_ids(self, engine: Engine) -> None:
        """Ask the engine which model ids it serves (once per engine process; again at the next scan if it failed)."""
        assert self.session is not None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, KeyError):
            async with self.session.get(engine.endpoint.rstrip("/") + "/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=SERVED_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return
                listed = await resp.json(content_type=None)
                ids = tuple(str(m["id"]) for m in listed["data"] if isinstance(m.get("id"), str))
            if ids:
                self._served[engine.key] = ids
                current = self.engines.get(engine.name)
                if current is not None and current.key == engine.key:
                    current.served = ids
                    self._rename()

    def resolve(self, model: str) -> Engine | None:
        name = self._names.get(model)
        return None if name is None else self.engines.get(name)

    def skipped_as(self, model: str) -> Skipped | None:
        """The model ``model`` names among those the last scan skipped (its segment's name, else its header's)."""
        return next((s for s in self.skipped if s.name == model), None) or next(
            (s for s in self.skipped if s.model == model), None)

    async def asked(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for the engines being asked their served ids (the router's first report)."""
        tasks = list(self._asking.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def find(self, model: str) -> Engine | None:
        """The engine ``model`` names; a name nobody answers to rescans first (a model that just started)."""
        asked = time.monotonic()
        engine = self.resolve(model)
        if engine is None:
            await self.refresh(unless_since=asked)
            engine = self.resolve(model)
        return engine

    def serving(self) -> list[Engine]:
        """The engines requests can go to (not gone), by name."""
        return sorted((e for e in self.engines.values() if e.state != GONE), key=lambda e: e.name)

    async def run(self, every_s: float) -> None:
        """Rescan every ``every_s`` seconds until cancelled."""
        while True:
            with contextlib.suppress(OSError):
                await self.refresh()
            await asyncio.sleep(every_s)
