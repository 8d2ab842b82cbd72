"""The memory a rank worker holds: the usual backends, with a per-rank capacity where it means something.

On a GPU each rank draws on its own device, so the cuda backend is used as it is. On the host
every rank shares one machine: the scheduler claims the whole model's bytes (all ranks) against
``KVCACHED_HOST_CAPACITY`` once, so a rank's own ledger only enforces the rank's optional cap
(what a GPU's memory size would be). ``null`` maps nothing: it isolates the broadcast cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..backends import Backend, Geometry, make_backend
from ..backends.host import HostBackend
from ..backends.ledger import CapacityLedger
from ..settings import settings

RANK_BACKENDS = ("host", "cuda", "null")
UNLIMITED = 1 << 62


class RankLedger(CapacityLedger):
    """A host ledger private to one rank: the machine-wide share is claimed by the scheduler."""

    def _others(self) -> int:
        return 0


class NullBackend(Backend):
    """Maps nothing, answers at once: what is left of a map or unmap is the broadcast itself."""

    name = "null"

    def __init__(self, geometry: Geometry, device: int = 0, capacity: int | None = None) -> None:
        super().__init__(geometry, device)
        self.capacity = UNLIMITED if capacity is None else capacity
        self.held = 0

    def map_pages(self, pages: Sequence[int]) -> list[int]:
        room = max(0, (self.capacity - self.held) // self.geometry.bundle_bytes)
        done = list(pages[:room])
        self.held += len(done) * self.geometry.bundle_bytes
        return done

    def unmap_pages(self, pages: Sequence[int]) -> None:
        self.held = max(0, self.held - len(pages) * self.geometry.bundle_bytes)

    def capacity_bytes(self) -> int:
        return self.capacity

    def free_bytes(self) -> int:
        return max(0, self.capacity - self.held)

    def buffer(self, layer: int, kv: int) -> None:
        raise RuntimeError("the null backend holds no memory")

    def close(self) -> None:
        self.held = 0


def make_rank_backend(name: str, geometry: Geometry, device: int = 0, capacity: int | None = None) -> Backend:
    """The backend of one rank; ``capacity`` caps a host or null rank (a GPU rank has its device's)."""
    if name == "null":
        return NullBackend(geometry, device, capacity)
    if name == "host":
        return HostBackend(geometry, device, ledger=RankLedger(capacity or settings().host_capacity_bytes))
    if capacity is not None:
        raise ValueError(f"a per-rank capacity applies to the host and null backends, not {name!r}")
    return make_backend(name, geometry, device)
