"""Optional native loop for the CUDA backend's hot path: ``cuda_native.c``, built when the package is installed.

A layer-separated page id is dozens of driver calls. Made one by one from Python, each call
pays the interpreter's round trip, which costs more than the binding call itself: coming back
to the interpreter between calls is what costs (``benchmarks/vmm.py`` measures the backend with
and without this loop against a C program making the same calls; docs/cuda.md has the figures). The extension ``kvcached_core.backends._cuda_native``
(no CUDA headers: it receives the driver's entry points and cuda-python's own struct pointers)
backs every page id of a ``map_pages`` call in one call that also releases the GIL for its whole
duration and makes the backend's context current itself (a Python guard for that is one more
binding round trip per call, which the page layout's short page ids feel).

``KVCACHED_CUDA_NATIVE``: ``auto`` (default: use it when it was built, in both layouts; else say
once why not), ``0`` (never), ``1`` (always; the backend fails without it). Without it the backend
stays on cuda-python.
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import Any

from .. import native

NATIVE_ENV = native.PARTS["cuda"].env


def load() -> tuple[ModuleType | None, str]:
    """The extension module, or None and why not."""
    return native.load("cuda")


class _Vmm(ctypes.Structure):
    _fields_ = [("create", ctypes.c_void_p), ("map", ctypes.c_void_p), ("access", ctypes.c_void_p),
                ("unmap", ctypes.c_void_p), ("release", ctypes.c_void_p), ("prop", ctypes.c_void_p),
                ("desc", ctypes.c_void_p), ("size", ctypes.c_size_t), ("nbases", ctypes.c_size_t),
                ("bases", ctypes.POINTER(ctypes.c_uint64)), ("getcur", ctypes.c_void_p), ("push", ctypes.c_void_p),
                ("pop", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class NativeVmm:
    """The extension's loop bound to one backend's ranges (handles are plain ints here)."""

    def __init__(self, module: ModuleType, prop: Any, access: Any, slice_bytes: int, bases: list[int],
                 ctx: int) -> None:
        driver = ctypes.CDLL("libcuda.so.1")  # the library cuda-python already loaded
        vmm = _Vmm()
        for field, symbol in (("create", "cuMemCreate"), ("map", "cuMemMap"), ("access", "cuMemSetAccess"),
                              ("unmap", "cuMemUnmap"), ("release", "cuMemRelease"), ("getcur", "cuCtxGetCurrent"),
                              ("push", "cuCtxPushCurrent_v2"), ("pop", "cuCtxPopCurrent_v2")):
            setattr(vmm, field, ctypes.cast(getattr(driver, symbol), ctypes.c_void_p))
        vmm.ctx = ctx
        vmm.prop = prop.getPtr()
        vmm.desc = access.getPtr()
        vmm.size = slice_bytes
        vmm.nbases = len(bases)
        self._bases = (ctypes.c_uint64 * len(bases))(*bases)
        vmm.bases = self._bases
        self._vmm = vmm
        self._keep = (prop, access, driver)  # the structs and the library must outlive the helper
        self._addr = ctypes.addressof(vmm)
        self._map_pages = module.map_pages
        self._unmap = module.unmap
        self._release = module.release

    def map_pages(self, offsets: list[int], pooled: list[int]) -> tuple[int, int, int, list[int], list[int]]:
        """Back several page ids in one call: (error, step, page ids done, their handles, spare handles).

        ``step``: 1 = create, 2 = map, 3 = access, 4 = making the context current failed; the spare
        handles are valid and unmapped (the pool's again)."""
        return self._map_pages(self._addr, offsets, pooled)

    def unmap(self, start: int, length: int) -> int:
        return self._unmap(self._addr, start, length)

    def release(self, handles: list[int]) -> int:
        return self._release(self._addr, handles) if handles else 0


__all__ = ["NATIVE_ENV", "NativeVmm", "load"]
