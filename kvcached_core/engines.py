"""Engine plugins: discovery through the ``kvcached.engines`` entry-point group, and the pieces
every plugin shares (the exhaustion error, allocation that may wait): the one face plugins import,
with :mod:`kvcached_core` and :mod:`kvcached_core.settings`.

Listing reads installed distributions' metadata only; nothing is imported until
:func:`load_engine` is called, so ``kvctl`` can show plugins whose engine (torch, vLLM, ...) is
heavy or missing. A plugin's entry point names an :class:`EngineInfo`.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:
    from .allocator.compact_staged import CompactStep, CompactTicket
    from .allocator.manager import KVCacheManager
    from .backends import Geometry
    from .bounds import endpoint_problem
    from .hostmem import available_ram_bytes, process_bytes, total_ram_bytes
    from .segment.layout import LIMIT_DEFERRED, MAX_GROUPS
    from .segment.names import sanitize
    from .tp import TPWorker

# What plugins use of the allocator, loaded on first use (listing plugins imports none of it).
_EXPORTS = {
    "KVCacheManager": "allocator.manager", "CompactStep": "allocator.compact_staged",
    "CompactTicket": "allocator.compact_staged", "Geometry": "backends", "TPWorker": "tp",
    "endpoint_problem": "bounds", "sanitize": "segment.names",
    "LIMIT_DEFERRED": "segment.layout",  # KVCacheManager.limit_status while a lowered limit waits for room
    "MAX_GROUPS": "segment.layout",  # the KV cache groups KVCacheManager.publish_groups takes at most
    # the host's memory (a CPU engine's device) and this process's (its working memory there)
    "total_ram_bytes": "hostmem", "available_ram_bytes": "hostmem", "process_bytes": "hostmem",
}
__getattr__, __dir__ = lazy_exports("kvcached_core", _EXPORTS, None, globals(), submodules=False)

GROUP = "kvcached.engines"
WAIT_POLL_S = 0.01
# Every engine integration passes this as ``KVCacheManager(refill_linger_s=...)``: beside a serving engine the
# refill thread sleeps until an alloc wakes it. Lingering, it looks every 0.5 ms and takes the GIL from the engine's
# scheduling thread at each look (benchmarks/probes/refill_linger.py: ~6,800 looks in a 9 s CPU run of 45 allocs,
# 44 asleep); a scheduling pass is long next to one wake-up. The manager's own default lingers, for tight alloc
# loops (benchmarks/vmm.py).
ENGINE_LINGER_S = 0.0


@dataclass(frozen=True)
class EngineEntry:
    """One installed plugin, as its distribution declares it (not imported)."""

    name: str
    target: str  # "module:attribute"
    distribution: str | None
    version: str | None

    def load(self) -> EngineInfo:
        """Import the plugin and return its :class:`EngineInfo`."""
        return _load(EntryPoint(self.name, self.target, GROUP))


@dataclass(frozen=True)
class EngineInfo:
    """What a plugin says about itself; importing the module that holds it must stay cheap."""

    name: str
    summary: str
    modules: tuple[str, ...] = ()  # import names the plugin needs at run time (e.g. "torch")
    cache: str = ""  # "module:attribute" of its cache class, imported on demand
    example: str = ""
    extras: tuple[str, ...] = field(default_factory=tuple)  # pip extras that install ``modules``

    def missing(self) -> list[str]:
        """Modules the plugin needs that are not installed (checked without importing them)."""
        return [name for name in self.modules if importlib.util.find_spec(name) is None]


def installed_engines() -> list[EngineEntry]:
    """Plugins registered under ``kvcached.engines``, sorted by name; none is imported."""
    found: dict[str, EngineEntry] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        found.setdefault(ep.name, EngineEntry(
            name=ep.name, target=ep.value,
            distribution=dist.metadata["Name"] if dist is not None else None,
            version=dist.version if dist is not None else None,
        ))
    return sorted(found.values(), key=lambda e: e.name)


def load_engine(name: str) -> EngineInfo:
    """Import the plugin registered as ``name``; raises LookupError when none is."""
    for entry in installed_engines():
        if entry.name == name:
            return entry.load()
    known = ", ".join(e.name for e in installed_engines()) or "none installed"
    raise LookupError(f"no engine plugin named {name!r} ({known})")


def _load(ep: EntryPoint) -> EngineInfo:
    info = ep.load()
    if not isinstance(info, EngineInfo):
        raise TypeError(f"entry point {ep.name!r} ({ep.value}) is not an EngineInfo but {type(info).__name__}")
    return info


class KVCacheExhausted(RuntimeError):
    """The allocator said no: the model's limit or the device has no room for the blocks asked for.

    Raised by plugins instead of running on with a partial cache. Nothing was allocated; the
    caller may free sequences, raise the limit (``kvctl limit``), or retry with ``wait``.
    """

    def __init__(self, model: str, needed: int, available: int, limit_bytes: int | None,
                 block_tokens: int, waited: float = 0.0) -> None:
        self.model = model
        self.needed_blocks = needed
        self.available_blocks = available
        self.limit_bytes = limit_bytes
        self.waited_s = waited
        limit = "no limit" if limit_bytes is None else f"limit {limit_bytes} bytes"
        after = f" after waiting {waited:.1f}s" if waited else ""
        super().__init__(
            f"KV cache of {model!r} exhausted{after}: needed {needed} blocks ({needed * block_tokens} tokens), "
            f"{available} available ({limit}); free sequences, raise the limit, or pass wait=SECONDS"
        )


def alloc_blocks(manager: KVCacheManager, n: int, *, wait: float = 0.0) -> list[int]:
    """``n`` blocks from ``manager``, polling up to ``wait`` seconds (``inf``: forever) before raising
    :class:`KVCacheExhausted`. Waiting helps when a controller raises the limit or another model
    gives memory back; blocks this process holds are not freed by waiting.
    """
    started = time.monotonic()
    while True:
        ids = manager.alloc(n)
        if ids is not None:
            return ids
        waited = time.monotonic() - started
        if waited >= wait:
            limit = None if manager.limit_pages is None else manager.limit_pages * manager.bundle_bytes
            raise KVCacheExhausted(manager.model, n, manager.available_size(), limit,
                                   manager.block_tokens, waited if wait > 0 else 0.0)
        time.sleep(min(WAIT_POLL_S, max(0.0, wait - waited)))


__all__ = [
    "GROUP", "LIMIT_DEFERRED", "MAX_GROUPS", "CompactStep", "CompactTicket", "EngineEntry", "EngineInfo", "Geometry",
    "KVCacheExhausted", "KVCacheManager", "TPWorker", "alloc_blocks", "available_ram_bytes", "endpoint_problem",
    "installed_engines", "load_engine", "process_bytes", "sanitize", "total_ram_bytes",
]
