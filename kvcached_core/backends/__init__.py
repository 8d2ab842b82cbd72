"""Memory backends: ``host`` (mmap + madvise, runs anywhere) and ``cuda`` (CUDA virtual memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend, BackendError, BackendUnavailable, Geometry

if TYPE_CHECKING:
    from ..settings import Settings

BACKENDS = ("host", "cuda")


def make_backend(name: str, geometry: Geometry, device: int = 0, *, settings: Settings | None = None) -> Backend:
    """The backend called ``name``; ``settings``: its configuration (default: the process's)."""
    if name == "host":
        from .host import HostBackend

        return HostBackend(geometry, device, settings=settings)
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(geometry, device, settings=settings)
    raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "BackendError", "BackendUnavailable", "Geometry", "make_backend", "BACKENDS"]
