"""Memory backends: ``host`` (mmap + madvise, runs anywhere) and ``cuda`` (CUDA virtual memory)."""

from __future__ import annotations

from .base import Backend, BackendError, BackendUnavailable, Geometry

BACKENDS = ("host", "cuda")


def make_backend(name: str, geometry: Geometry, device: int = 0) -> Backend:
    if name == "host":
        from .host import HostBackend

        return HostBackend(geometry, device)
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(geometry, device)
    raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "BackendError", "BackendUnavailable", "Geometry", "make_backend", "BACKENDS"]
