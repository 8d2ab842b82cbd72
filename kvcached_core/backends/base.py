"""The backend interface: what the allocator needs from memory, host or GPU."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class BackendError(RuntimeError):
    """A memory operation failed for a reason other than running out (which is a miss, not an error)."""


class BackendUnavailable(BackendError):
    """The backend cannot run here (no GPU, no driver, no cuda-python); the message says what is missing."""


@dataclass(frozen=True)
class Geometry:
    """Shape of a model's KV memory: ``num_pages`` page ids, each mapped in every layer and KV buffer."""

    page_size: int
    num_pages: int
    num_layers: int
    num_kv_buffers: int

    @property
    def bundle_bytes(self) -> int:
        return self.page_size * self.num_layers * self.num_kv_buffers

    @property
    def range_bytes(self) -> int:
        """Virtual bytes of one layer's one KV buffer."""
        return self.page_size * self.num_pages


class Backend(ABC):
    """Reserve virtual space once, then map and unmap page ids (each across all layers and buffers).

    ``map_pages`` returns the ids it mapped, a prefix of those asked for: running out of
    capacity is a short answer, not an exception. Both calls come from the allocator's threads,
    never concurrently for the same page.
    """

    name: str = "base"
    # Page ids the refill thread maps per call once the pool is short (up to the pool's maximum):
    # more than one where a call's fixed cost is a sizeable share of a page id's (see CudaBackend).
    refill_batch: int = 1

    def __init__(self, geometry: Geometry, device: int = 0) -> None:
        self.geometry = geometry
        self.device = device

    @abstractmethod
    def map_pages(self, pages: Sequence[int]) -> list[int]: ...

    @abstractmethod
    def unmap_pages(self, pages: Sequence[int]) -> None: ...

    @abstractmethod
    def capacity_bytes(self) -> int:
        """Total memory of the device this backend draws on."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Memory the device could still give (best known estimate)."""

    def headroom_bytes(self) -> int:
        """Device memory a growth leaves free beside the engines' working memory (the CUDA backend's headroom)."""
        return 0

    def bind_claims(self, set_claimed: Callable[[int], None],  # noqa: B027 - optional hook
                    own_segment: tuple[int, int] | None = None) -> None:
        """Hook through which the backend records the bytes it holds in the segment (host only);
        ``own_segment`` is that segment's (st_dev, st_ino), so the backend never counts itself twice."""

    def budget_free_bytes(self) -> int | None:
        """What the budget this backend shares with other allocators leaves (``backends.ledger``), at most a few
        milliseconds old; None when it shares no budget (the driver's out-of-memory is the limit)."""
        return None

    def trim_pool(self, keep_pages: int) -> None:  # noqa: B027 - optional hook
        """Release cached physical handles beyond ``keep_pages`` (backends with a handle pool)."""

    @abstractmethod
    def close(self) -> None: ...
