"""One kernel that moves compaction's blocks on a CUDA device: each block read once and written once.

torch's indexed copy (``rows[:, dst] = rows[:, src]``) gathers into a temporary and scatters out of
it, so every byte moved crosses device memory four times. This kernel copies each (range, block)
pair straight from its source to its destination, 16 bytes a load.

It is compiled by NVRTC from :data:`SOURCE` (part of this module) into a cubin for the device's
own architecture, in memory, once per process and device, and loaded from memory: nothing is read
from or written to a file, and no driver JIT cache is involved (a cubin is machine code, not PTX).
Where NVRTC is missing or refuses, :func:`mover` says why and :func:`move_if_able` leaves the copy to
torch's gather and scatter.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

KERNEL = "kvc_move_blocks"
THREADS = 256  # a CTA copies one (range, block) pair
UNROLL = 4  # 16-byte words each thread loads before it stores them: more bytes in flight per thread
SOURCE = r"""
#ifndef UNROLL
#define UNROLL 4
#endif
extern "C" __global__ void kvc_move_blocks(char* base, long long range_stride, long long page_stride,
                                           long long slot_stride, long long bpp, const long long* pairs,
                                           long long moves, long long words) {
    long long pair = blockIdx.x;
    long long r = pair / moves, m = pair - r * moves;
    long long s = pairs[2 * m], d = pairs[2 * m + 1];
    const uint4* __restrict__ from =
        (const uint4*)(base + r * range_stride + (s / bpp) * page_stride + (s % bpp) * slot_stride);
    uint4* __restrict__ to = (uint4*)(base + r * range_stride + (d / bpp) * page_stride + (d % bpp) * slot_stride);
    long long i = threadIdx.x;
    const long long step = blockDim.x;
    for (; i + (UNROLL - 1) * step < words; i += UNROLL * step) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = from[i + u * step];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) to[i + u * step] = v[u];
    }
    for (; i < words; i += step) to[i] = from[i];
}
"""


class CopyKernelUnavailable(RuntimeError):
    """NVRTC or the driver could not build or load the kernel here (the message says which and why)."""


@dataclass(frozen=True)
class Mover:
    """The loaded kernel of one device."""

    module: Any
    function: Any
    threads: int = THREADS

    def move(self, rows: Any, moves: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` for each move, in every range of ``rows`` (the uint8
        ``[ranges, pages, blocks_per_page, block_bytes]`` view of ``CudaBackend.all_blocks``), on torch's
        current stream of that device; the caller waits for it. The caller checks :func:`fits` first.
        :class:`CopyKernelUnavailable` when the launch fails.

        The move list goes to the device as a tensor on that same stream: torch's caching allocator
        reuses its memory only after the work queued there, the kernel included. (From pageable host
        memory the copy is done with the host buffer before it returns.)"""
        import torch

        flat = array.array("q", itertools.chain.from_iterable(moves))  # one buffer, no tensor built per tuple
        with torch.cuda.device(rows.device):  # its context current on this thread (a poller serves every device)
            self.launch(rows, torch.frombuffer(flat, dtype=torch.long).to(rows.device, non_blocking=True))

    def launch(self, rows: Any, pairs: Any) -> None:
        """The kernel alone, over moves already on the device: ``pairs`` is the contiguous int64
        ``src0, dst0, src1, dst1, ...``. The device's context must be current (:meth:`move` makes it so)."""
        import torch
        from cuda.bindings import driver as cu

        ranges, _, bpp, block = rows.shape
        moves = pairs.numel() // 2
        values = (rows.data_ptr(), rows.stride(0), rows.stride(1), rows.stride(2), bpp, pairs.data_ptr(), moves,
                  block // 16)
        types = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong,
                 ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong)
        stream = cu.CUstream(torch.cuda.current_stream(rows.device).cuda_stream)
        _check(cu.cuLaunchKernel(self.function, ranges * moves, 1, 1, self.threads, 1, 1, 0, stream,
                                 (values, types), 0), "cuLaunchKernel")


def fits(rows: Any, moves: Sequence[tuple[int, int]]) -> bool:
    """The kernel's 16-byte loads and stores are aligned, and no block is both read and written."""
    if rows.element_size() != 1 or rows.dim() != 4 or rows.stride(3) != 1:
        return False
    if any(v % 16 for v in (rows.data_ptr(), rows.stride(0), rows.stride(1), rows.stride(2), rows.shape[3])):
        return False
    sources = {s for s, _ in moves}
    return not any(d in sources for _, d in moves)


_lock = threading.Lock()
_movers: dict[int, Mover | str] = {}  # device -> its kernel, or why there is none
_building: set[int] = set()  # devices whose kernel a background thread builds now


def mover(device: int, *, wait: bool = True) -> Mover | str | None:
    """The kernel on ``device``, or the reason it cannot be had (said once in the log).

    The first call builds it (an NVRTC compile). ``wait=False`` never builds on the caller's
    thread: it starts the build in the background and answers None until the kernel is there, so a
    compaction under its allocator's lock does not hold the engine for a compile."""
    found = _movers.get(device)
    if found is not None:
        return found
    if not wait:
        _start_build(device)
        return None
    with _lock:
        found = _movers.get(device)
        if found is None:
            try:
                found = _build(device)
            except Exception as exc:  # noqa: BLE001 - any failure to build means torch's copy, said once
                found = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CopyKernelUnavailable) else str(exc)
                log.info("compaction copies with torch's gather and scatter on cuda:%d: %s", device, found)
            _movers[device] = found
        return found


def _start_build(device: int) -> None:
    """Start building ``device``'s kernel in a background thread, unless it is built or being built."""
    with _lock:
        if device in _movers or device in _building:
            return
        _building.add(device)

    def build() -> None:
        try:
            mover(device)
        finally:
            with _lock:
                _building.discard(device)

    threading.Thread(target=build, name=f"kvcached-copy-kernel-{device}", daemon=True).start()


def move_if_able(rows: Any, moves: Sequence[tuple[int, int]]) -> bool:
    """Copy the moves with the kernel (see :meth:`Mover.move`) when it can: False, nothing copied, when the moves
    do not :func:`fit <fits>`, the kernel is still being built (this call starts that in the background, so a
    compaction under its allocator's lock never waits for a compile) or cannot be had, or its launch fails (the
    kernel is then given up for the process, said once in the log)."""
    if not fits(rows, moves):
        return False
    device = rows.device.index or 0
    kernel = mover(device, wait=False)
    if not isinstance(kernel, Mover):
        return False
    try:
        kernel.move(rows, moves)
    except CopyKernelUnavailable as exc:
        with _lock:
            _movers[device] = str(exc)
        log.warning("compaction copies with torch's gather and scatter on cuda:%d from now on: %s", device, exc)
        return False
    return True


def _check(result: Any, what: str) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise CopyKernelUnavailable(f"{what} failed: {err!r}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


def _build(device: int, unroll: int = UNROLL, threads: int = THREADS) -> Mover:
    """Compile :data:`SOURCE` for ``device`` and load it (``unroll`` and ``threads`` vary only for
    ``benchmarks/probes/copy_kernel.py``, which times the choices)."""
    try:
        import torch
        from cuda.bindings import driver as cu
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CopyKernelUnavailable(f"no NVRTC here ({exc})") from None
    major, minor = torch.cuda.get_device_capability(device)
    try:
        program = _check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"kvc_move_blocks.cu", 0, [], []),
                         "nvrtcCreateProgram")
    except (RuntimeError, OSError) as exc:  # libnvrtc not found
        raise CopyKernelUnavailable(f"NVRTC cannot start: {exc}") from None
    options = [f"--gpu-architecture=sm_{major}{minor}".encode(), f"-DUNROLL={unroll}".encode()]
    try:
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(compiled[0]) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            text = b" " * size
            nvrtc.nvrtcGetProgramLog(program, text)
            raise CopyKernelUnavailable(f"NVRTC refused the kernel: {text.decode(errors='replace').strip()[:300]}")
        size = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # the device's primary context is current on this thread
        module = _check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        function = _check(cu.cuModuleGetFunction(module, KERNEL.encode()), "cuModuleGetFunction")
    return Mover(module, function, threads)
