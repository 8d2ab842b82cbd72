"""A fake cuda-python driver for CPU tests: ``cuda.bindings.driver`` as far as the CUDA backend uses it.

:class:`FakeDriver` answers every call with the tuple cuda-python returns (``(CUresult, value...)``) and
refuses what the CUDA driver API documentation says the real driver refuses; each refusal is recorded in
:attr:`FakeDriver.refused`, so a test can assert the backend never broke a rule. The rules (each cited at
its check) are from the driver API reference, "Virtual Memory Management"; ``tests/test_cuda_backend.py``
runs the same probes against a real GPU to keep the fake honest.

No device memory exists: handles, mappings and reservations are bookkeeping, and a kernel's use of memory
is :meth:`FakeDriver.touch`. ``cuMemGetInfo`` answers ``free = total - memory held by live allocations -
external_bytes`` (``external_bytes`` stands for other processes and torch's own allocations).

The :func:`fake_cuda` fixture makes the CUDA backend load a fresh FakeDriver and keeps the native C map
loop off (it binds the real ``libcuda``), yielding the driver.
"""

from __future__ import annotations

import bisect
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import pytest

MiB, GiB = 1 << 20, 1 << 30
HOST_PAGE = 4096
VA_START = 0x7F00_0000_0000  # where the fake's reservations start (an address UVA would plausibly give)


class CUresult(IntEnum):
    """The driver's error codes the fake answers (values as in cuda.h)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


class CUdevice_attribute(IntEnum):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CUmemAllocationType(IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUevent_flags(IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_DISABLE_TIMING = 2


class _Opaque:
    """cuda-python's opaque handle types: built from an int, ``int()`` gives it back."""

    __slots__ = ("_value",)

    def __init__(self, value: int = 0) -> None:
        self._value = int(value)

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and int(other) == self._value  # type: ignore[call-overload]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._value))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdevice(_Opaque):
    pass


class CUcontext(_Opaque):
    pass


class CUdeviceptr(_Opaque):
    pass


class CUmemGenericAllocationHandle(_Opaque):
    pass


class CUevent(_Opaque):
    pass


class CUstream(_Opaque):
    pass


CU_STREAM_LEGACY = CUstream(1)


class CUmemLocation:
    def __init__(self) -> None:
        self.type: Any = 0
        self.id = 0


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type: Any = 0
        self.location = CUmemLocation()
        self.requestedHandleTypes = 0


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags: Any = 0


@dataclass
class _Allocation:
    size: int
    device: int
    released: bool = False
    maps: int = 0  # mappings of it still in place: its memory is freed once released and unmapped


@dataclass
class _Mapping:
    size: int
    handle: int
    access: bool = False  # cuMemSetAccess granted (every new mapping starts without)


@dataclass(frozen=True)
class Refusal:
    call: str
    code: CUresult
    why: str


OK = CUresult.CUDA_SUCCESS
INVALID = CUresult.CUDA_ERROR_INVALID_VALUE


class FakeDriver:
    """The driver API's virtual memory calls over ``device_count`` devices of ``total_bytes`` each."""

    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUevent_flags = CUevent_flags
    CUdevice = CUdevice
    CUcontext = CUcontext
    CUdeviceptr = CUdeviceptr
    CUmemGenericAllocationHandle = CUmemGenericAllocationHandle
    CUevent = CUevent
    CUstream = CUstream
    CU_STREAM_LEGACY = CU_STREAM_LEGACY
    CUmemLocation = CUmemLocation
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, total_bytes: int = 80 * GiB, granularity: int = 2 * MiB, device_count: int = 1) -> None:
        self.total_bytes = total_bytes
        self.granularity = granularity
        self.device_count = device_count
        self.external_bytes = 0  # memory held outside this driver's handles (other processes, torch)
        self.refused: list[Refusal] = []
        self.calls: Counter[str] = Counter()
        self.faults: list[tuple[int, int]] = []  # touch() of memory unmapped or without access
        self.recorded_events = 0
        self._lock = threading.RLock()
        self._initialized = False
        self._next_id = 1
        self._next_va = VA_START
        self._reservations: dict[int, int] = {}  # start -> size
        self._allocations: dict[int, _Allocation] = {}  # handle -> allocation (until its memory is freed)
        self._map_starts: list[int] = []  # sorted starts of _mappings
        self._mappings: dict[int, _Mapping] = {}
        self._contexts: dict[int, list[int]] = {}  # context id -> [device, retain count]
        self._events: set[int] = set()
        self._tls = threading.local()

    # -- counters for assertions ---------------------------------------------------------------------
    @property
    def live_handles(self) -> int:
        """Handles created and not released."""
        return sum(1 for a in self._allocations.values() if not a.released)

    @property
    def allocated_bytes(self) -> int:
        """Device memory held by allocations (a released handle's memory lasts while it is mapped)."""
        return sum(a.size for a in self._allocations.values())

    @property
    def mapped_bytes(self) -> int:
        return sum(m.size for m in self._mappings.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reservations.values())

    @property
    def reservations(self) -> dict[int, int]:
        return dict(self._reservations)

    @property
    def live_events(self) -> int:
        return len(self._events)

    @property
    def retained_contexts(self) -> int:
        return sum(count for _dev, count in self._contexts.values())

    def free_bytes(self, device: int = 0) -> int:
        held = sum(a.size for a in self._allocations.values() if a.device == device)
        return max(0, self.total_bytes - held - self.external_bytes)

    def accessible(self, ptr: int, size: int) -> bool:
        """True when every byte of the range is mapped with access granted (a kernel may touch it)."""
        with self._lock:
            cover = self._covering(ptr, size)
            return cover is not None and all(self._mappings[s].access for s in cover)

    def touch(self, ptr: int, size: int) -> CUresult:
        """A kernel's use of the range: an illegal address (recorded in :attr:`faults`) unless accessible."""
        if self.accessible(ptr, size):
            return OK
        self.faults.append((ptr, size))
        return CUresult.CUDA_ERROR_ILLEGAL_ADDRESS

    # -- plumbing ------------------------------------------------------------------------------------
    def _refuse(self, call: str, code: CUresult, why: str) -> tuple[CUresult]:
        self.refused.append(Refusal(call, code, why))
        return (code,)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id << 12

    def _ready(self, call: str, *, context: bool = False) -> tuple[CUresult] | None:
        """A refusal when the driver is not initialised (every call but cuInit returns
        CUDA_ERROR_NOT_INITIALIZED then) or, for calls on the current context, none is current."""
        self.calls[call] += 1
        if not self._initialized:
            return self._refuse(call, CUresult.CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called")
        if context and not self._stack():
            return self._refuse(call, CUresult.CUDA_ERROR_INVALID_CONTEXT, "no context is current in this thread")
        return None

    def _stack(self) -> list[int]:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _granular(self, *values: int) -> bool:
        return all(int(v) % self.granularity == 0 for v in values)

    def _reservation_of(self, ptr: int, size: int) -> int | None:
        for start, length in self._reservations.items():
            if start <= ptr and ptr + size <= start + length:
                return start
        return None

    def _overlapping(self, ptr: int, size: int) -> list[int]:
        """Starts of the mappings that share a byte with ``[ptr, ptr + size)``."""
        i = bisect.bisect_right(self._map_starts, ptr) - 1
        i = max(i, 0)
        out = []
        while i < len(self._map_starts) and self._map_starts[i] < ptr + size:
            start = self._map_starts[i]
            if start + self._mappings[start].size > ptr:
                out.append(start)
            i += 1
        return out

    def _covering(self, ptr: int, size: int) -> list[int] | None:
        """The whole mappings that exactly tile ``[ptr, ptr + size)``, or None (a hole or a part of one)."""
        starts = self._overlapping(ptr, size)
        at = ptr
        for start in starts:
            if start != at:
                return None
            at += self._mappings[start].size
        return starts if starts and at == ptr + size else None

    # -- initialisation, devices, contexts -----------------------------------------------------------
    def cuInit(self, flags: int) -> tuple[CUresult]:
        self.calls["cuInit"] += 1
        if flags != 0:
            return self._refuse("cuInit", INVALID, "flags must be 0")
        self._initialized = True
        return (OK,)

    def cuDriverGetVersion(self) -> tuple[CUresult, int]:
        self.calls["cuDriverGetVersion"] += 1
        return OK, 12080

    def cuGetErrorName(self, error: Any) -> tuple[CUresult, bytes]:
        try:
            return OK, CUresult(int(error)).name.encode()
        except ValueError:
            return (INVALID, b"")  # type: ignore[return-value]

    def cuDeviceGetCount(self) -> Any:
        return self._ready("cuDeviceGetCount") or (OK, self.device_count)

    def cuDeviceGet(self, ordinal: int) -> Any:
        if refused := self._ready("cuDeviceGet"):
            return refused
        if not 0 <= ordinal < self.device_count:
            return self._refuse("cuDeviceGet", CUresult.CUDA_ERROR_INVALID_DEVICE, f"no device {ordinal}")
        return OK, CUdevice(ordinal)

    def _device(self, call: str, dev: Any) -> tuple[CUresult] | None:
        if not 0 <= int(dev) < self.device_count:
            return self._refuse(call, CUresult.CUDA_ERROR_INVALID_DEVICE, f"no device {int(dev)}")
        return None

    def cuDeviceGetAttribute(self, attrib: Any, dev: Any) -> Any:
        if refused := self._ready("cuDeviceGetAttribute") or self._device("cuDeviceGetAttribute", dev):
            return refused
        return OK, 1 if attrib == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED else 0

    def cuDeviceGetName(self, length: int, dev: Any) -> Any:
        if refused := self._ready("cuDeviceGetName") or self._device("cuDeviceGetName", dev):
            return refused
        return OK, b"Fake VMM GPU".ljust(length, b"\0")[:length]

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> Any:
        if refused := self._ready("cuDevicePrimaryCtxRetain") or self._device("cuDevicePrimaryCtxRetain", dev):
            return refused
        with self._lock:
            ctx = 0x1000 + int(dev)
            entry = self._contexts.setdefault(ctx, [int(dev), 0])
            entry[1] += 1
        return OK, CUcontext(ctx)

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> Any:
        if refused := self._ready("cuDevicePrimaryCtxRelease") or self._device("cuDevicePrimaryCtxRelease", dev):
            return refused
        with self._lock:
            entry = self._contexts.get(0x1000 + int(dev))
            if entry is None or entry[1] == 0:
                return self._refuse("cuDevicePrimaryCtxRelease", CUresult.CUDA_ERROR_INVALID_CONTEXT,
                                    "the primary context is not retained")
            entry[1] -= 1
        return (OK,)

    def cuCtxGetCurrent(self) -> Any:
        if refused := self._ready("cuCtxGetCurrent"):
            return refused
        stack = self._stack()
        return OK, CUcontext(stack[-1] if stack else 0)

    def cuCtxPushCurrent(self, ctx: Any) -> Any:
        if refused := self._ready("cuCtxPushCurrent"):
            return refused
        entry = self._contexts.get(int(ctx))
        if entry is None or entry[1] == 0:
            return self._refuse("cuCtxPushCurrent", CUresult.CUDA_ERROR_INVALID_CONTEXT, "not a retained context")
        self._stack().append(int(ctx))
        return (OK,)

    def cuCtxPopCurrent(self) -> Any:
        if refused := self._ready("cuCtxPopCurrent", context=True):
            return refused
        return OK, CUcontext(self._stack().pop())

    def cuCtxSynchronize(self) -> Any:
        return self._ready("cuCtxSynchronize", context=True) or (OK,)

    # -- events --------------------------------------------------------------------------------------
    def cuEventCreate(self, flags: Any) -> Any:
        if refused := self._ready("cuEventCreate", context=True):  # an event belongs to the current context
            return refused
        with self._lock:
            event = self._new_id()
            self._events.add(event)
        return OK, CUevent(event)

    def _event(self, call: str, event: Any) -> Any:
        if refused := self._ready(call):
            return refused
        if int(event) not in self._events:
            return self._refuse(call, CUresult.CUDA_ERROR_INVALID_HANDLE, "not a live event")
        return None

    def cuEventRecord(self, event: Any, stream: Any) -> Any:
        if refused := self._event("cuEventRecord", event):
            return refused
        self.recorded_events += 1
        return (OK,)

    def cuEventSynchronize(self, event: Any) -> Any:
        return self._event("cuEventSynchronize", event) or (OK,)

    def cuEventDestroy(self, event: Any) -> Any:
        if refused := self._event("cuEventDestroy", event):
            return refused
        with self._lock:
            self._events.discard(int(event))
        return (OK,)

    # -- virtual memory ------------------------------------------------------------------------------
    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> Any:
        if refused := self._ready("cuMemGetAllocationGranularity") or self._device(
                "cuMemGetAllocationGranularity", prop.location.id):
            return refused
        return OK, self.granularity

    def cuMemGetInfo(self) -> Any:
        # "Returns in *free and *total respectively, the free and total amount of memory available for
        # allocation by the CUDA context": the current context's device.
        if refused := self._ready("cuMemGetInfo", context=True):
            return refused
        device = self._contexts[self._stack()[-1]][0]
        with self._lock:
            return OK, self.free_bytes(device), self.total_bytes

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> Any:
        call = "cuMemAddressReserve"
        if refused := self._ready(call):
            return refused
        size, alignment, addr = int(size), int(alignment), int(addr)
        # "The size and address parameters must be a multiple of the host page size and the alignment must be a
        # power of two or zero for default alignment." (an H100, driver 580, refused 6 MiB and 28 MiB)
        if alignment < 0 or alignment & (alignment - 1):
            return self._refuse(call, INVALID, f"alignment {alignment} is not a power of two")
        if size <= 0 or size % HOST_PAGE or addr % HOST_PAGE:
            return self._refuse(call, INVALID, f"size {size} / address {addr:#x} not a multiple of the host page")
        if flags != 0:
            return self._refuse(call, INVALID, "flags must be 0")
        align = max(alignment, self.granularity)  # 0: the default alignment
        with self._lock:
            start = -(-self._next_va // align) * align
            self._next_va = start + size + self.granularity  # a gap: neighbouring ranges never touch
            self._reservations[start] = size
        return OK, CUdeviceptr(start)

    def cuMemAddressFree(self, ptr: Any, size: int) -> Any:
        call = "cuMemAddressFree"
        if refused := self._ready(call):
            return refused
        with self._lock:
            # "Frees a virtual address range reserved by cuMemAddressReserve. The size must match what was given
            # to cuMemAddressReserve."
            if self._reservations.get(int(ptr)) != int(size):
                return self._refuse(call, INVALID, f"{int(ptr):#x}+{size} is not a reservation")
            del self._reservations[int(ptr)]
        return (OK,)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        call = "cuMemCreate"
        if refused := self._ready(call) or self._device(call, prop.location.id):
            return refused
        size = int(size)
        # "size of this allocation must be a multiple of the value given via cuMemGetAllocationGranularity
        # with the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag"; flags: "for future use, must be zero now".
        if size <= 0 or not self._granular(size) or flags != 0:
            return self._refuse(call, INVALID, f"size {size} is not a multiple of the granularity (or flags set)")
        device = int(prop.location.id)
        with self._lock:
            if size > self.free_bytes(device):
                return self._refuse(call, CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"{size} bytes past the device's memory")
            handle = self._new_id()
            self._allocations[handle] = _Allocation(size, device)
        return OK, CUmemGenericAllocationHandle(handle)

    def cuMemRelease(self, handle: Any) -> Any:
        call = "cuMemRelease"
        if refused := self._ready(call):
            return refused
        with self._lock:
            alloc = self._allocations.get(int(handle))
            # "If handle is not a valid handle the behavior is undefined": the fake refuses it.
            if alloc is None or alloc.released:
                return self._refuse(call, CUresult.CUDA_ERROR_INVALID_HANDLE, "not a live handle")
            # "The generic memory handle can be freed when there are still outstanding mappings made with this
            # handle": the memory is freed once every mapping of it is unmapped.
            alloc.released = True
            if alloc.maps == 0:
                del self._allocations[int(handle)]
        return (OK,)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> Any:
        call = "cuMemMap"
        if refused := self._ready(call):
            return refused
        ptr, size, offset = int(ptr), int(size), int(offset)
        # "Both ptr, size, and offset must be a multiple of the value given via cuMemGetAllocationGranularity with
        # the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag"; offset: "currently must be zero" (cuMemMap cannot map a
        # handle at an offset); flags "must be zero".
        if size <= 0 or not self._granular(ptr, size):
            return self._refuse(call, INVALID, f"{ptr:#x}+{size} not a multiple of the granularity")
        if offset != 0 or flags != 0:
            return self._refuse(call, INVALID, f"offset {offset} (must be 0) or flags set")
        with self._lock:
            alloc = self._allocations.get(int(handle))
            if alloc is None or alloc.released:
                return self._refuse(call, CUresult.CUDA_ERROR_INVALID_HANDLE, "not a live handle")
            # "offset + size must be less than the size of the memory allocation"
            if size > alloc.size:
                return self._refuse(call, INVALID, f"{size} bytes of a {alloc.size}-byte allocation")
            # "This range must be an address reservation previously reserved with cuMemAddressReserve"
            if self._reservation_of(ptr, size) is None:
                return self._refuse(call, INVALID, f"{ptr:#x}+{size} is outside every reserved range")
            if self._overlapping(ptr, size):
                return self._refuse(call, INVALID, f"{ptr:#x}+{size} is already mapped")
            bisect.insort(self._map_starts, ptr)
            self._mappings[ptr] = _Mapping(size, int(handle))
            alloc.maps += 1
        return (OK,)

    def cuMemUnmap(self, ptr: Any, size: int) -> Any:
        call = "cuMemUnmap"
        if refused := self._ready(call):
            return refused
        ptr, size = int(ptr), int(size)
        with self._lock:
            # "The range must be the entire contiguous address range that was mapped to. In other words,
            # cuMemUnmap cannot unmap a sub-range of an address range mapped by cuMemCreate / cuMemMap."
            # Measured on an H100 (driver 580, tests/test_cuda_backend.py's parity test): a granular range inside a
            # reservation that overlaps no mapping at all is unmapped without complaint (a no-op).
            if (size > 0 and self._granular(ptr, size) and self._reservation_of(ptr, size) is not None
                    and not self._overlapping(ptr, size)):
                return (OK,)
            cover = self._covering(ptr, size) if size > 0 and self._granular(ptr, size) else None
            if cover is None:
                return self._refuse(call, INVALID, f"{ptr:#x}+{size} is not whole mapped ranges")
            for start in cover:
                mapping = self._mappings.pop(start)
                del self._map_starts[bisect.bisect_left(self._map_starts, start)]
                alloc = self._allocations[mapping.handle]
                alloc.maps -= 1
                # "Any backing memory allocations will be freed if there are no existing mappings and there are
                # no unreleased memory handles."
                if alloc.released and alloc.maps == 0:
                    del self._allocations[mapping.handle]
        return (OK,)

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Sequence[Any], count: int) -> Any:
        call = "cuMemSetAccess"
        if refused := self._ready(call):
            return refused
        ptr, size = int(ptr), int(size)
        if count != len(desc) or count == 0:
            return self._refuse(call, INVALID, f"count {count} for {len(desc)} descriptors")
        for d in desc:
            if refused := self._device(call, d.location.id):
                return refused
        with self._lock:
            # "The range must be a fully mapped address range containing all allocations created by
            # cuMemMap / cuMemCreate."
            cover = self._covering(ptr, size) if size > 0 else None
            if cover is None:
                return self._refuse(call, INVALID, f"{ptr:#x}+{size} is not fully mapped")
            granted = any(int(d.flags) != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE for d in desc)
            for start in cover:
                self._mappings[start].access = granted
        return (OK,)


# -- probes: the same calls on the fake and on a real driver (tests/test_cuda_backend.py compares them) ----------
# "unmap an unmapped range" is a probe the H100 (driver 580) answered with success: it is not refused here either.
PROBES_REFUSED = frozenset({
    "reserve aligned to 6 MiB", "reserve aligned to 28 MiB", "create half a granule", "map at a non-zero offset",
    "map outside the reservation", "map half a granule", "map onto a mapped address",
    "unmap part of a mapping", "set access on an unmapped range", "create past the device's memory",
})


def run_probes(d: Any, device: int = 0) -> dict[str, int]:
    """Each probe's result code (an int) on driver module ``d`` (cuda-python's or a :class:`FakeDriver`):
    the calls the fake's rules are about. Everything a probe holds is given back before it returns."""
    ok = d.CUresult.CUDA_SUCCESS
    assert d.cuInit(0)[0] == ok
    dev = d.cuDeviceGet(device)[1]
    ctx = d.cuDevicePrimaryCtxRetain(dev)[1]
    assert d.cuCtxPushCurrent(ctx)[0] == ok
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    access = d.CUmemAccessDesc()
    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    gran = int(d.cuMemGetAllocationGranularity(
        prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)[1])
    total = int(d.cuMemGetInfo()[2])
    ranges: list[tuple[int, int]] = []
    handles: list[Any] = []
    maps: list[tuple[int, int]] = []

    def reserve(size: int, align: int = 0) -> tuple[int, int]:
        res = d.cuMemAddressReserve(size, align, 0, 0)
        if res[0] == ok:
            ranges.append((int(res[1]), size))
            return int(ok), int(res[1])
        return int(res[0]), 0

    def create(size: int) -> tuple[int, Any]:
        res = d.cuMemCreate(size, prop, 0)
        if res[0] == ok:
            handles.append(res[1])
            return int(ok), res[1]
        return int(res[0]), None

    def map_(ptr: int, size: int, handle: Any, offset: int = 0) -> int:
        err = d.cuMemMap(ptr, size, offset, handle, 0)[0]
        if err == ok:
            maps.append((ptr, size))
        return int(err)

    def unmap(ptr: int, size: int) -> int:
        err = d.cuMemUnmap(ptr, size)[0]
        if err == ok:
            maps[:] = [m for m in maps if not ptr <= m[0] < ptr + size]
        return int(err)

    out: dict[str, int] = {}
    try:
        for mib in (0, 2, 8, 6, 28):
            out[f"reserve aligned to {mib} MiB"] = reserve(4 * gran, mib * MiB)[0]
        _, va = reserve(8 * gran)
        out["create half a granule"] = create(gran // 2)[0]
        out["create one granule"], one = create(gran)
        _, two = create(2 * gran)
        out["map at a non-zero offset"] = map_(va, gran, two, offset=gran)
        out["map outside the reservation"] = map_(va + 8 * gran, gran, one)
        out["map half a granule"] = map_(va, gran // 2, one)
        out["map, set access"] = map_(va, gran, one) or int(d.cuMemSetAccess(va, gran, [access], 1)[0])
        out["map onto a mapped address"] = map_(va, gran, two)
        out["unmap an unmapped range"] = unmap(va + 4 * gran, gran)
        out["set access on an unmapped range"] = int(d.cuMemSetAccess(va + 4 * gran, gran, [access], 1)[0])
        out["map two granules beside it"] = map_(va + gran, 2 * gran, two)
        out["unmap part of a mapping"] = unmap(va + gran, gran)
        handles.remove(two)  # released while mapped: the driver frees its memory at the unmap
        out["release a mapped handle"] = int(d.cuMemRelease(two)[0])
        out["unmap two neighbouring mappings at once"] = unmap(va, 3 * gran)
        out["create past the device's memory"] = create(-(-(total + gran) // gran) * gran)[0]
    finally:
        for ptr, size in list(maps):
            d.cuMemUnmap(ptr, size)
        for handle in handles:
            d.cuMemRelease(handle)
        for ptr, size in ranges:
            d.cuMemAddressFree(ptr, size)
        d.cuCtxPopCurrent()
        d.cuDevicePrimaryCtxRelease(dev)
    return out


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    """The CUDA backend on a :class:`FakeDriver` (80 GiB, 2 MiB granularity; set its attributes before building
    a backend), with the native map loop off."""
    from kvcached_core.backends import cuda as cuda_backend
    from kvcached_core.backends.cuda_native import NATIVE_ENV

    driver = FakeDriver()
    monkeypatch.setattr(cuda_backend, "_load_driver", lambda: driver)
    monkeypatch.setenv(NATIVE_ENV, "0")
    torch = sys.modules.get("torch")
    if torch is not None:  # on a GPU host: no fence on a real stream for a fake device (the backend asks torch)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    yield driver


__all__ = ["PROBES_REFUSED", "FakeDriver", "Refusal", "fake_cuda", "run_probes"]
