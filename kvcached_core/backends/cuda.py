"""CUDA backend: KV pages in GPU virtual memory through cuda-python's driver API (VMM).

One virtual range is reserved at construction (``cuMemAddressReserve``); mapping a page id
backs it with pinned device memory (``cuMemCreate`` at the device's granularity, ``cuMemMap``,
``cuMemSetAccess``); unmapping returns it. The driver's cost is per physical handle, not per
byte, so the layout decides the price of a page id (``layout=`` or ``KVCACHED_CUDA_LAYOUT``):

``layer`` (default)
    layer-separated: buffer ``b`` of layer ``l`` owns the range starting at
    ``(l * num_kv_buffers + b) * range_bytes``, so each layer's K (or V) is one single-stride
    tensor over blocks, as attention kernels index it. A page id is ``num_layers x
    num_kv_buffers`` handles of ``page_size`` (``cuMemMap`` cannot map a handle at an offset,
    so one handle cannot serve several ranges).
``page``
    page-major: page id ``p`` is one handle of a whole page bundle at ``p * bundle_bytes``;
    layer ``l`` buffer ``b`` is the ``page_size`` slice at ``(l * num_kv_buffers + b) *
    page_size`` inside it. One handle per page id grows much faster, but a layer's blocks are
    no longer one stride apart: views are ``[pages, blocks_per_page, ...]``.

How a page id is backed and given back (the handle pool, one driver call per run of neighbours, the C map
loop, running out of memory as a miss, the deferred unmapper and the event each unmap waits for) is
:mod:`.cuda_mapping`'s, the backend's base.

Driver calls release the GIL (cuda-bindings >= 12.9.1), so the allocator's refill thread maps
while the engine's thread keeps allocating. torch is optional: :meth:`CudaBackend.buffer` and
:func:`tensor_views` import it only when called and hand tensors over through DLPack.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import native
from ..settings import CUDA_LAYOUTS, Settings
from ..settings import settings as process_settings
from ..sizes import format_bytes
from .base import Backend, BackendError, BackendUnavailable, Geometry
from .cuda_mapping import PageMapping, runs
from .cuda_native import NATIVE_ENV, NativeVmm
from .cuda_native import load as load_native
from .ledger import BUDGET_MAX_AGE_S, CapacityLedger, DeviceScan

log = logging.getLogger(__name__)
LAYOUTS = CUDA_LAYOUTS
LAYOUT_ENV = "KVCACHED_CUDA_LAYOUT"
POOL_ENV = "KVCACHED_CUDA_POOL_PAGES"
ASYNC_ENV = "KVCACHED_CUDA_ASYNC_UNMAP"
DELAY_ENV = "KVCACHED_CUDA_UNMAP_DELAY_MS"


@dataclass(frozen=True)
class ViewSpec:
    """Where one layer's one KV buffer lives: byte offset from the base, shape and strides in bytes."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def range_spec(layout: str, g: Geometry, layer: int, kv: int) -> ViewSpec:
    """The raw bytes of one buffer as ``[num_pages, page_size]`` rows."""
    if not (0 <= layer < g.num_layers and 0 <= kv < g.num_kv_buffers):
        raise IndexError(f"layer {layer} / kv {kv} out of range ({g.num_layers} layers, {g.num_kv_buffers} buffers)")
    slot = layer * g.num_kv_buffers + kv
    if layout == "layer":
        return ViewSpec(slot * g.range_bytes, (g.num_pages, g.page_size), (g.page_size, 1))
    return ViewSpec(slot * g.page_size, (g.num_pages, g.page_size), (g.bundle_bytes, 1))


def block_spec(layout: str, g: Geometry, layer: int, kv: int, block_bytes: int, num_blocks: int) -> ViewSpec:
    """Blocks of one buffer: ``[num_blocks, block_bytes]`` where blocks are one stride apart, else
    ``[num_pages, blocks_per_page, block_bytes]`` (page-major layout, or pages that blocks do not tile)."""
    if block_bytes <= 0 or block_bytes > g.page_size:
        raise ValueError(f"block_bytes {block_bytes} must be in 1..page_size ({g.page_size})")
    raw = range_spec(layout, g, layer, kv)
    bpp = g.page_size // block_bytes
    if layout == "layer" and g.page_size % block_bytes == 0:
        if not 0 < num_blocks <= g.num_pages * bpp:
            raise ValueError(f"num_blocks {num_blocks} does not fit {g.num_pages} pages of {bpp} blocks")
        return ViewSpec(raw.offset, (num_blocks, block_bytes), (block_bytes, 1))
    return ViewSpec(raw.offset, (g.num_pages, bpp, block_bytes), (raw.strides[0], block_bytes, 1))


# -- DLPack: hand a device range to torch without torch asking the driver about the pointer ----------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor)))]
_KDL_CUDA = 2
_KDL_UINT = 1
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _torch_bytes(ptr: int, device: int, spec: ViewSpec, keep: list) -> Any:
    """A uint8 torch tensor over device memory at ``ptr`` (not owned: ``keep`` holds the structs)."""
    try:
        import torch  # torch is optional
        from torch.utils.dlpack import from_dlpack
    except ImportError:
        raise BackendError("torch views need torch (pip install torch)") from None
    ndim = len(spec.shape)
    shape = (ctypes.c_int64 * ndim)(*spec.shape)
    strides = (ctypes.c_int64 * ndim)(*spec.strides)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ptr + spec.offset
    managed.dl_tensor.device = _DLDevice(_KDL_CUDA, device)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    keep.append((managed, shape, strides))  # the tensor borrows them; the backend keeps them alive
    tensor = from_dlpack(_capsule_new(ctypes.addressof(managed), b"dltensor", None))
    assert tensor.dtype == torch.uint8
    return tensor


def _shape_as(tensor: Any, dtype: Any, shape: Sequence[int] | None) -> Any:
    """Reinterpret the last (byte) dimension as ``dtype`` and split it into ``shape``."""
    if dtype is not None:
        tensor = tensor.view(dtype)
    if shape is not None:
        shape = tuple(shape)
        last = tensor.shape[-1]
        total = 1
        for dim in shape:
            total *= dim
        if total != last:
            raise ValueError(f"shape {shape} holds {total} elements, a block holds {last}")
        tensor = tensor.unflatten(-1, shape)
    return tensor


# -- the driver -------------------------------------------------------------------------------------
_warned: set[tuple[int, int, int]] = set()  # (device, budget, headroom) said once per process


def _warn_unreachable(device: int, budget: int | None, total: int, headroom: int) -> None:
    """One warning line per process when a device budget is more than the device can give KV (its memory less
    the headroom; growth then stops at the device's room, before the budget), or the headroom is all of it."""
    if headroom < total and (budget is None or budget <= total - headroom) or (device, budget or 0, headroom) in _warned:
        return
    _warned.add((device, budget or 0, headroom))
    if headroom >= total:
        log.warning("kvcached: the headroom of device %d (%s, KVCACHED_DEVICE_HEADROOM) is all of its %s: no KV page "
                    "can be mapped there", device, format_bytes(headroom), format_bytes(total))
        return
    log.warning("kvcached: the KV budget of device %d (%s, KVCACHED_DEVICE_BUDGET) is more than the device can give "
                "(%s total - %s headroom = %s): growth stops where the device's free memory less the headroom and "
                "the engines' working memory ends", device, format_bytes(budget), format_bytes(total),
                format_bytes(headroom), format_bytes(total - headroom))


RESERVE_ALIGNMENT_CAP = 1 << 30  # no need to align a range beyond 1 GiB: maps only need the granularity


def reserve_alignment(page_size: int, granularity: int) -> int:
    """The alignment to pass ``cuMemAddressReserve`` for ranges mapped in ``page_size`` steps.

    The driver takes only a power of two (or 0) as the alignment: 6 MiB or 28 MiB is refused with
    ``CUDA_ERROR_INVALID_VALUE`` (measured on an H100, driver 580). Every mapped address lies a multiple of
    ``page_size`` from the range's start, so the largest power of two dividing ``page_size`` keeps each one as
    aligned as the page allows; never below the VMM granularity (``cuMemMap`` needs that) nor above
    :data:`RESERVE_ALIGNMENT_CAP`.
    """
    if granularity <= 0 or granularity & (granularity - 1):
        raise ValueError(f"granularity {granularity} is not a power of two")
    if page_size <= 0 or page_size % granularity:
        raise ValueError(f"page size {page_size} is not a multiple of the granularity {granularity}")
    return max(granularity, min(page_size & -page_size, RESERVE_ALIGNMENT_CAP))


def _load_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            raise BackendUnavailable(
                "backend 'cuda' needs cuda-python (pip install cuda-python), which is not installed"
            ) from None
    return driver


class CudaBackend(PageMapping, Backend):
    """Page ids in reserved GPU virtual memory, backed on demand by pooled physical handles."""

    name = "cuda"

    def __init__(self, geometry: Geometry, device: int = 0, *, layout: str | None = None,
                 pool_pages: int | None = None, async_unmap: bool | None = None,
                 unmap_delay_s: float | None = None, native: str | None = None,
                 budget_bytes: int | None = None, settings: Settings | None = None) -> None:
        """``budget_bytes``: this device's KV budget shared with the other allocators on it (default:
        ``KVCACHED_DEVICE_BUDGET``; none: the driver's out-of-memory is the budget). ``settings``: the defaults of
        the other arguments (default: the process's)."""
        super().__init__(geometry, device)
        cfg = self.settings = settings or process_settings()
        self.layout = cfg.cuda_layout if layout is None else layout
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        self.pool_pages = cfg.cuda_pool_pages if pool_pages is None else pool_pages
        self.async_unmap = cfg.cuda_async_unmap if async_unmap is None else async_unmap
        self.unmap_delay_s = cfg.cuda_unmap_delay_s if unmap_delay_s is None else unmap_delay_s
        self.native_mode = cfg.mode(NATIVE_ENV) if native is None else native
        self._native = None
        self.native_reason = "not requested" if self.native_mode == "off" else ""
        g = geometry
        self.slices = g.num_layers * g.num_kv_buffers if self.layout == "layer" else 1
        # A page-major page id is cheap enough to back that a map_pages call's fixed cost is a sizeable
        # share of it: the refill maps four per call there (benchmarks/vmm.py compares batch 1 and 4).
        self.refill_batch = 4 if self.layout == "page" else 1
        self.slice_bytes = g.page_size if self.layout == "layer" else g.bundle_bytes
        self.va_bytes = g.range_bytes * g.num_layers * g.num_kv_buffers
        self.created = self.released = 0
        self.revived = 0
        self._closed = False
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._mapped = {}
        self._pool = []
        self._pending = {}
        self._fences = {}
        self._busy = set()
        self._unmapper = None
        self._stopping = False
        self._async_error = None
        self._set_claimed: Callable[[int], None] | None = None
        self.ledger: CapacityLedger | None = None  # the device budget, when one is set (see _setup)
        self._scan: DeviceScan | None = None  # the device's segments: the budget's ledger, else a scan alone
        self._budget_lock = threading.Lock()  # a claim and the map it allows are one step (refill vs alloc)
        self._budget_arg = budget_bytes
        self.headroom = 0  # bytes of the device a growth leaves free (KVCACHED_DEVICE_HEADROOM, see _setup)
        self._views_keep: list = []
        self._all_blocks: dict[int, Any] = {}  # all_blocks views by block size
        self._va = 0
        self._bases = []
        self._ctx = None

        d = self._d = _load_driver()
        self._OK = d.CUresult.CUDA_SUCCESS
        self._OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        try:
            err = d.cuInit(0)[0]
        except Exception as exc:  # noqa: BLE001 - the driver library itself is missing
            raise BackendUnavailable(
                f"backend 'cuda' needs the NVIDIA driver, but libcuda.so could not be loaded ({type(exc).__name__})"
            ) from None
        if err != self._OK:
            raise BackendUnavailable(f"backend 'cuda' found no usable GPU: cuInit failed with {self._err_name(err)}")
        count = self._check("cuDeviceGetCount", d.cuDeviceGetCount())
        if not 0 <= device < count:
            raise BackendUnavailable(f"backend 'cuda' has no device {device}: {count} CUDA device(s) visible")
        self._dev = self._check("cuDeviceGet", d.cuDeviceGet(device))
        vmm = self._check("cuDeviceGetAttribute", d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self._dev))
        if not vmm:
            raise BackendUnavailable(f"backend 'cuda' needs virtual memory management, which device {device} lacks")
        self.device_name = self._check("cuDeviceGetName", d.cuDeviceGetName(96, self._dev))
        self.device_name = self.device_name.split(b"\0")[0].decode(errors="replace")
        self.driver_version = self._check("cuDriverGetVersion", d.cuDriverGetVersion())
        self._ctx = self._check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(self._dev))
        self._ctx_id = int(self._ctx)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        d, g = self._d, self.geometry
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        self._prop = prop
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        with self._context():
            self.granularity = self._check("cuMemGetAllocationGranularity", d.cuMemGetAllocationGranularity(
                prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
            if g.page_size % self.granularity:
                raise BackendError(
                    f"page size {g.page_size} is not a multiple of device {self.device}'s VMM granularity "
                    f"{self.granularity}: set KVCACHED_PAGE_SIZE_MB to a multiple of {self.granularity >> 20 or 1}"
                )
            _free, self._total = self._check("cuMemGetInfo", d.cuMemGetInfo())
        self.headroom = self.settings.device_headroom.of(int(self._total))
        budget, configured = self._budget_arg, self.settings.device_budget
        if budget is None and configured is not None:
            budget = configured.of(int(self._total))
        total = int(self._total)
        _warn_unreachable(self.device, budget, total, self.headroom)
        if budget is not None:
            self.ledger = CapacityLedger(budget, self.settings.shm_dir, backend=self.name, device=self.device,
                                         working_max=total)
        self._scan = self.ledger or DeviceScan(total, self.settings.shm_dir, backend=self.name, device=self.device)
        align = reserve_alignment(g.page_size, int(self.granularity))
        with self._context():
            self._va = int(self._check("cuMemAddressReserve", d.cuMemAddressReserve(self.va_bytes, align, 0, 0)))
        # where slice s of page 0 starts; slice s of page p is p * slice_bytes further
        self._bases = [self._va + s * g.range_bytes for s in range(self.slices)] if self.layout == "layer" else [self._va]
        if self.native_mode != "off":
            module, why = load_native()
            if module is not None:
                try:
                    self._native = NativeVmm(module, prop, access, self.slice_bytes, self._bases, self._ctx_id)
                except (OSError, AttributeError) as exc:
                    why = f"cannot bind the driver: {exc}"
            self.native_reason = why
            if self._native is None and self.native_mode == "on":
                raise BackendError(f"{NATIVE_ENV}=1 but the native helper is unavailable: {why}")
            if self._native is None:
                native.say_unavailable("cuda", why)

    # -- plumbing --------------------------------------------------------------------------------
    def _addr(self, page: int, s: int) -> int:
        return self._bases[s] + page * self.slice_bytes

    def _check_pages(self, pages: Sequence[int]) -> None:
        if self._closed:
            raise BackendError("the CUDA backend is closed")
        if self._async_error is not None:
            self._raise_async()
        n = self.geometry.num_pages
        if len(pages) == 1:  # the refill thread's usual call: skip min/max
            if not 0 <= pages[0] < n:
                raise BackendError(f"page id {pages[0]} out of range 0..{n - 1}")
        elif pages and (min(pages) < 0 or max(pages) >= n):
            bad = next(p for p in pages if not 0 <= p < n)
            raise BackendError(f"page id {bad} out of range 0..{n - 1}")

    def _claimed(self) -> None:
        if self.ledger is not None:
            self.ledger.settle(self.held_bytes)
        elif self._set_claimed is not None:
            self._set_claimed(self.held_bytes())

    def _growth(self, pages: list[int], count: int) -> int:
        """Device memory that backing ``pages[:count]`` takes: a page still mapped (its deferred unmap not run)
        costs nothing, and pooled handles are used before new ones."""
        new = sum(1 for p in pages[:count] if p not in self._mapped)
        return max(0, new * self.slices - len(self._pool)) * self.slice_bytes

    def _fit_budget(self, pages: list[int]) -> list[int]:
        """The prefix of ``pages`` the device budget lets this backend back, claimed (all, else one at a time).
        A shorter answer is a miss, as the driver's out-of-memory is."""
        ledger = self.ledger
        assert ledger is not None
        held = self.held_bytes()
        if ledger.claim_total(held + self._growth(pages, len(pages))):
            return pages
        count = 0
        while count < len(pages) and ledger.claim_total(held + self._growth(pages, count + 1)):
            count += 1
        return pages[:count]

    def device_room(self, max_age_s: float = 0.0) -> int:
        """What a growth may take of the device now: its free memory (every process's use counted) less the
        headroom and the working memory the engines on it registered and do not hold yet (the others' counted at
        most ``max_age_s`` ago); negative when the device is already short."""
        with self._context():
            free, _total = self._check("cuMemGetInfo", self._d.cuMemGetInfo())
        assert self._scan is not None
        return int(free) - self.headroom - self._scan.working_bytes(max_age_s)

    def _fit_device(self, pages: list[int], max_age_s: float) -> list[int]:
        """The prefix of ``pages`` whose growth leaves the device its headroom and the engines' working memory
        (``KVCACHED_DEVICE_HEADROOM``, :meth:`KVCacheManager.register_working_memory`; the others' counted at most
        ``max_age_s`` ago): a shorter answer is a miss, as the budget's is. Pages on their way back are waited
        for once before a page is refused."""
        if not pages:
            return pages
        room = self.device_room(max_age_s)
        if self._growth(pages, len(pages)) <= room:
            return pages
        if self._pending or self._busy:  # memory is on its way back: finish the deferred unmaps, then count again
            self._drain()
            room = self.device_room()
        count = len(pages)
        while count and self._growth(pages, count) > room:
            count -= 1
        return pages[:count]

    # -- Backend ---------------------------------------------------------------------------------
    def map_pages(self, pages: Sequence[int]) -> list[int]:
        """Back ``pages`` with memory; stops at the first page the device cannot back (a miss).

        A page whose deferred unmap has not run yet is taken back as it is: no driver call.
        """
        pages = list(pages)
        self._check_pages(pages)
        with self._budget_lock:
            if self.ledger is None:
                return self._map_claimed(self._fit_device(pages, 0.0))
            # Under a budget every claim scans the device's segments: the last one's working figure is fresh enough.
            return self._map_claimed(self._fit_budget(self._fit_device(pages, BUDGET_MAX_AGE_S)))

    def _map_claimed(self, pages: list[int]) -> list[int]:
        if not pages:
            return []
        try:
            if self._native is not None:  # the C loop makes our context current itself
                done = self._map(pages)
            else:
                with self._context():
                    done = self._map(pages)
        finally:
            self._claimed()  # what is held now: a claim not used (a miss, an error) goes back
        return done

    def unmap_pages(self, pages: Sequence[int]) -> None:
        """Return ``pages``. With deferred unmapping (the default) a backend thread does the driver
        work, so the caller (often holding the allocator's lock) does not wait milliseconds per page id
        (``benchmarks/vmm.py``'s shrink rows)."""
        pages = sorted(pages)
        self._check_pages(pages)
        with self._lock:
            missing = [p for p in pages if p not in self._mapped or p in self._pending or p in self._busy]
        if missing:
            raise BackendError(f"page ids {missing[:8]} are not mapped")
        if self.async_unmap:
            self._defer(pages)
            return
        with self._context():
            fence = [self._fence()]
            self._wait_fences(fence, fence)
            self._unmap(pages, keep=True)
        self._claimed()

    def flush(self) -> None:
        """Wait until every unmap asked for so far has returned its memory."""
        if not self._closed:
            self._drain()

    def trim_pool(self, keep_pages: int) -> None:
        """Release pooled handles beyond ``keep_pages`` page ids' worth."""
        if self._closed:
            return
        self._drain()
        with self._lock:
            keep = max(0, keep_pages) * self.slices
            drop = self._pool[keep:]
            del self._pool[keep:]
        with self._context():
            for h in drop:
                self._check("cuMemRelease", self._d.cuMemRelease(h))
                self.released += 1
        self._claimed()

    def bind_claims(self, set_claimed: Callable[[int], None], own_segment: tuple[int, int] | None = None) -> None:
        self._set_claimed = set_claimed
        if self.ledger is not None:
            self.ledger.bind(set_claimed, own_segment)
        self._claimed()

    def headroom_bytes(self) -> int:
        return self.headroom

    def capacity_bytes(self) -> int:
        """The device budget when one is set, else the device's memory."""
        return self.ledger.capacity if self.ledger is not None else int(self._total)

    def free_bytes(self) -> int:
        """What a growth may take of the device (:meth:`device_room`) plus what our pool holds and could map
        without asking; under a device budget, no more than the budget leaves."""
        free = max(0, self.device_room())
        ours = self.pooled_bytes() + self.returning_bytes()
        if self.ledger is not None:
            free = min(free, self.ledger.free_bytes(BUDGET_MAX_AGE_S))
        return free + ours

    def budget_free_bytes(self) -> int | None:
        """Under a device budget: what it leaves, and no more than the device's room (:meth:`device_room`), plus
        what our pool and deferred unmaps could map again."""
        if self.ledger is None:
            return None
        free = min(self.ledger.free_bytes(BUDGET_MAX_AGE_S), max(0, self.device_room(BUDGET_MAX_AGE_S)))
        return free + self.pooled_bytes() + self.returning_bytes()

    def pooled_bytes(self) -> int:
        """Unmapped physical handles kept for regrowth."""
        return len(self._pool) * self.slice_bytes

    def returning_bytes(self) -> int:
        """Pages whose deferred unmap has not finished yet."""
        return (len(self._pending) + len(self._busy)) * self.slices * self.slice_bytes

    def mapped_bytes(self) -> int:
        """Pages mapped for the allocator (not counting those on their way back)."""
        return len(self._mapped) * self.slices * self.slice_bytes - self.returning_bytes()

    def held_bytes(self) -> int:
        """Device memory this backend holds: mapped pages, pages being unmapped, the handle pool."""
        return len(self._mapped) * self.slices * self.slice_bytes + self.pooled_bytes()

    @property
    def base_address(self) -> int:
        return self._va

    # -- torch views -----------------------------------------------------------------------------
    def buffer(self, layer: int, kv: int, *, dtype: Any = None) -> Any:
        """A torch tensor over one layer's one KV buffer, ``[num_pages, page_size]`` bytes (or ``dtype``).

        Valid wherever pages are mapped; touching an unmapped page is an illegal address on the
        GPU. The tensor borrows the memory: it must not outlive :meth:`close`.
        """
        spec = range_spec(self.layout, self.geometry, layer, kv)
        return _shape_as(_torch_bytes(self._va, self.device, spec, self._views_keep), dtype, None)

    def blocks(self, layer: int, kv: int, block_bytes: int, num_blocks: int, *, dtype: Any = None,
               shape: Sequence[int] | None = None) -> Any:
        """Blocks of one buffer as the engine indexes them (see :func:`block_spec` for the shape)."""
        spec = block_spec(self.layout, self.geometry, layer, kv, block_bytes, num_blocks)
        return _shape_as(_torch_bytes(self._va, self.device, spec, self._views_keep), dtype, shape)

    def all_blocks(self, block_bytes: int) -> Any:
        """Every layer's every KV buffer at once: ``[num_layers * num_kv_buffers, num_pages, blocks_per_page,
        block_bytes]`` bytes, one view (kept, like the others, until :meth:`close`), so that one indexed copy
        moves a block in every range (:func:`kvcached_core.allocator.compact.device_copy`)."""
        g = self.geometry
        if not 0 < block_bytes <= g.page_size:
            raise ValueError(f"block_bytes {block_bytes} must be in 1..page_size ({g.page_size})")
        cached = self._all_blocks.get(block_bytes)
        if cached is None:
            layered = self.layout == "layer"  # see range_spec: where slot (layer, kv) and page p start
            spec = ViewSpec(0, (g.num_layers * g.num_kv_buffers, g.num_pages, g.page_size // block_bytes, block_bytes),
                            (g.range_bytes if layered else g.page_size, g.page_size if layered else g.bundle_bytes,
                             block_bytes, 1))
            cached = self._all_blocks[block_bytes] = _torch_bytes(self._va, self.device, spec, self._views_keep)
        return cached

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and release everything, free the virtual range and the context reference.

        Best effort: failures are reported as a RuntimeWarning, so the caller's own teardown
        (unlinking the segment) still runs.
        """
        if self._closed:
            return
        self._all_blocks.clear()
        with self._cv:
            self._stopping = True
            self._pending.clear()  # everything still mapped is unmapped below (after a context synchronize)
            fences = self._take_fences(list(self._fences))[1]
            self._cv.notify_all()
        if self._unmapper is not None and self._unmapper is not threading.current_thread():
            self._unmapper.join()
        self._closed = True
        d = self._d
        errors: list[str] = []

        def attempt(call: str, result: tuple) -> None:
            if result[0] != self._OK:
                errors.append(f"{call} failed: {self._err_name(result[0])}")

        if self._ctx is not None:
            with self._context():
                attempt("cuCtxSynchronize", d.cuCtxSynchronize())
                for event in fences:
                    d.cuEventDestroy(event)
                handles = [h for hs in self._mapped.values() for h in hs] + self._pool
                for _i, first, n in runs(sorted(self._mapped)):
                    for s in range(self.slices):
                        attempt("cuMemUnmap", d.cuMemUnmap(self._addr(first, s), n * self.slice_bytes))
                self._mapped.clear()
                self._pool = []
                for h in handles:
                    attempt("cuMemRelease", d.cuMemRelease(h))
                    self.released += 1
                if self._va:
                    attempt("cuMemAddressFree", d.cuMemAddressFree(self._va, self.va_bytes))
                    self._va = 0
            attempt("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(self._dev))
            self._ctx = None
        self._claimed()
        if errors:  # close runs on teardown paths (a sticky kernel fault makes every call fail): warn
            warnings.warn(f"CUDA backend close: {'; '.join(errors)}", RuntimeWarning, stacklevel=2)


def tensor_views(manager: Any, *, dtype: Any = None, shape: Sequence[int] | None = None) -> list[list[Any]]:
    """Torch tensors over every layer's every KV buffer of a ``backend="cuda"`` KVCacheManager.

    ``views[layer][kv]`` is ``[num_blocks, block_bytes]`` uint8 in the layer layout (block ``i``
    of the allocator is row ``i``), or ``[num_blocks, *shape]`` of ``dtype`` when given
    (``shape`` must fill a block). In the page layout no single-stride block tensor exists and
    the views are ``[num_pages, blocks_per_page, ...]``: block ``i`` is ``[i // bpp, i % bpp]``.
    """
    backend = manager.backend
    if not isinstance(backend, CudaBackend):
        raise TypeError(f"tensor_views needs a manager with backend='cuda', not {backend.name!r}")
    return [[backend.blocks(layer, kv, manager.block_bytes, manager.num_blocks, dtype=dtype, shape=shape)
             for kv in range(manager.num_kv_buffers)] for layer in range(manager.num_layers)]


__all__ = ["CudaBackend", "LAYOUTS", "ViewSpec", "block_spec", "range_spec", "reserve_alignment", "runs",
           "tensor_views"]
