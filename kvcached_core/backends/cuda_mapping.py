"""The driver work behind the CUDA backend's ``map_pages`` and ``unmap_pages``: physical handles, their pool, the
mapping and unmapping of page ids, and the deferred unmapper thread.

:class:`PageMapping` is a part of :class:`~kvcached_core.backends.cuda.CudaBackend` (its base): the backend
sets the state declared here when it is built and keeps the public face, the device budget and the views.

Unmapped handles go to a pool (up to ``pool_pages`` page ids, ``KVCACHED_CUDA_POOL_PAGES``,
default ``KVCACHED_MAX_RESERVED_PAGES``) so that regrowth skips ``cuMemCreate`` and shrinking
skips ``cuMemRelease``; ``trim_pool`` gives pooled memory back. Pages unmapped (or, on the
cuda-python path, mapped) in one call that sit next to each other get one ``cuMemUnmap`` /
``cuMemSetAccess`` per range instead of one per handle. Where a page id has several handles,
a small C loop (:mod:`.cuda_native`, an extension built when the package is installed) maps and grants it
in one call. Running out of device memory is a short answer from ``map_pages`` (a miss);
every other driver error raises :class:`BackendError` naming the call.

Unmapping is deferred by default (``KVCACHED_CUDA_ASYNC_UNMAP=0`` turns it off): the allocator
unmaps while it holds its lock, often inside an engine's ``free``, and a layer-separated page
id takes milliseconds to unmap (``benchmarks/vmm.py``, docs/cuda.md), so a backend thread does it instead, one page id at a time,
``KVCACHED_CUDA_UNMAP_DELAY_MS`` (20) after it was asked. A page asked for again before then is
handed back as it is, with no driver call; ``trim_pool``, ``flush`` and a
map that runs out of memory finish the deferred work at once, so a trim still returns its
memory before it answers. The delay is for regrowth, not for safety: every unmap first waits for
an event recorded when it was asked, on the stream the engine's kernels run on (torch's current
stream where torch has initialised CUDA, else the legacy default stream, which orders after every
blocking stream), so a kernel queued before a ``free`` never touches an unmapped page, however
late it runs (an engine that frees a step's blocks while the step still runs, as vLLM's async
scheduling does).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .base import BackendError
from .cuda_native import NativeVmm


def runs(pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Split ``pages`` (in order) into runs of consecutive ids: ``(index, first_page, count)``."""
    i, n = 0, len(pages)
    while i < n:
        j = i + 1
        while j < n and pages[j] == pages[j - 1] + 1:
            j += 1
        yield i, pages[i], j - i
        i = j


class PageMapping:
    """Page ids backed by pooled physical handles, and given back now or by a thread after a delay.

    The state below is the backend's, set when it is built (``CudaBackend.__init__`` and ``_setup``)."""

    device: int
    _d: Any  # the driver module (cuda-python)
    _OK: Any
    _OOM: Any
    _ctx: Any  # the device's primary context
    _ctx_id: int
    _native: NativeVmm | None  # the C map loop, when loaded
    _prop: Any  # the allocation properties cuMemCreate takes
    _access: list[Any]  # the access cuMemSetAccess grants
    _bases: list[int]  # where slice s of page 0 starts
    slices: int  # handles per page id
    slice_bytes: int  # bytes per handle
    pool_pages: int
    unmap_delay_s: float
    created: int  # physical handles, for tests and benchmarks
    released: int
    revived: int  # pages taken back before their deferred unmap ran
    _lock: threading.Lock  # guards the pool and the deferred-unmap sets
    _cv: threading.Condition
    _mapped: dict[int, list[Any]]  # page id -> its handles (pages waiting to be unmapped too)
    _pool: list[Any]
    _pending: dict[int, float]  # unmap asked for, not started: page -> when it is due
    _fences: dict[int, Any]  # page -> the event its unmap waits for (see _fence)
    _busy: set[int]  # being unmapped by the unmapper thread
    _unmapper: threading.Thread | None
    _stopping: bool
    _async_error: BaseException | None
    _claimed: Callable[[], None]  # the backend's own: tells its accounting what it holds now

    # -- the driver --------------------------------------------------------------------------------
    def _err_name(self, err: Any) -> str:
        try:
            res, name = self._d.cuGetErrorName(self._d.CUresult(int(err)))
            if res == self._OK and name:
                return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001 - naming an error must not raise another
            pass
        return str(err)

    def _check(self, call: str, result: tuple) -> Any:
        """Unwrap a driver result, raising BackendError naming ``call`` on failure."""
        err = result[0]
        if err != self._OK:
            raise BackendError(f"{call} failed: {self._err_name(err)}")
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def _context(self) -> _CtxGuard:
        return _CtxGuard(self)

    # -- mapping and unmapping -------------------------------------------------------------------
    def _map(self, pages: list[int]) -> list[int]:
        mapped = self._mapped
        native = self._native is not None
        done: list[int] = []
        fresh: list[int] = []  # mapped by this call (without access yet on the cuda-python path)
        todo: list[int] = []  # native path: mapped together in one call below
        for page in pages:
            if page in mapped:
                if not self._revive(page):
                    raise BackendError(f"page id {page} is already mapped")
                if page in mapped:  # revived: still mapped and accessible
                    done.append(page)
                    continue
            if native:
                todo.append(page)
                continue
            try:
                handles = self._map_one(page)
            except BackendError:
                self._rollback(done, fresh, 0)
                raise
            if handles is None:
                break  # out of device memory: a miss
            mapped[page] = handles
            done.append(page)
            fresh.append(page)
        if native:
            if todo:
                try:
                    done += self._map_native(todo)
                except BackendError:
                    self._rollback(done, [], 0)
                    raise
            return done
        return self._grant(done, fresh) if fresh else done

    def _map_native(self, pages: list[int]) -> list[int]:
        """Native path: create what the pool lacks, map and grant access, every page id in one
        GIL-free call. Returns the page ids backed, a prefix of ``pages`` (short: out of memory)."""
        native, slices, size, mapped = self._native, self.slices, self.slice_bytes, self._mapped
        assert native is not None
        out: list[int] = []
        drained = False
        while pages:
            pooled = self._take_pooled(len(pages) * slices)
            err, step, count, handles, spare = native.map_pages([p * size for p in pages], pooled)
            self.created += len(handles) + len(spare) - len(pooled)
            for i in range(count):
                mapped[pages[i]] = handles[i * slices:(i + 1) * slices]
            out += pages[:count]
            if not err:
                return out
            self._return(spare)
            page, pages = pages[count], pages[count:]
            if err == self._OOM:
                if step == 1 and not drained and (self._pending or self._busy):
                    drained = True  # memory is on its way back: finish the deferred unmaps, then retry
                    self._drain()
                    continue
                return out
            self._rollback(out, out, 0)
            call = {1: "cuMemCreate", 2: "cuMemMap", 4: "cuCtxPushCurrent"}.get(step, "cuMemSetAccess")
            raise BackendError(f"{call}(page {page}) failed: {self._err_name(err)}")
        return out

    def _map_one(self, page: int) -> list[Any] | None:
        """cuda-python path: the page id's handles, mapped; None when the device is out of memory."""
        handles = self._acquire(self.slices)
        if handles is None:
            return None
        size, bases, cmap, OK = self.slice_bytes, self._bases, self._d.cuMemMap, self._OK
        offset = page * size
        for s in range(self.slices):
            err = cmap(bases[s] + offset, size, 0, handles[s], 0)[0]
            if err != OK:
                for k in range(s):
                    self._check("cuMemUnmap", self._d.cuMemUnmap(bases[k] + offset, size))
                self._return(handles)
                if err == self._OOM:
                    return None
                raise BackendError(f"cuMemMap(page {page}) failed: {self._err_name(err)}")
        return handles

    def _revive(self, page: int) -> bool:
        """True when ``page`` was waiting to be unmapped: it is kept if the unmapper has not started
        on it, else we wait for the unmapper and the caller maps it afresh."""
        with self._cv:
            if page in self._pending:
                del self._pending[page]
                for event in self._take_fences([page])[1]:  # no unmap waits for it any more
                    self._d.cuEventDestroy(event)
                self.revived += 1
                return True
            if page not in self._busy:
                return False
            while page in self._busy:
                self._cv.wait()
            return True

    def _acquire(self, count: int) -> list[Any] | None:
        """``count`` handles, pooled first; None (nothing held) when the device is out of memory."""
        create, prop, size, OK = self._d.cuMemCreate, self._prop, self.slice_bytes, self._OK
        handles = self._take_pooled(count)
        drained = False
        while len(handles) < count:
            res = create(size, prop, 0)
            err = res[0]
            if err == OK:
                handles.append(res[1])
                self.created += 1
                continue
            if err == self._OOM and not drained and (self._pending or self._busy):
                drained = True  # memory is on its way back: finish the deferred unmaps, then retry
                self._drain()
                handles += self._take_pooled(count - len(handles))
                continue
            self._return(handles)
            if err == self._OOM:
                return None
            raise BackendError(f"cuMemCreate({size} bytes) failed: {self._err_name(err)}")
        return handles

    def _take_pooled(self, count: int) -> list[Any]:
        with self._lock:
            pool = self._pool
            take = min(count, len(pool))
            handles = pool[len(pool) - take:]
            del pool[len(pool) - take:]
        return handles

    def _grant(self, done: list[int], fresh: list[int]) -> list[int]:
        """cuda-python path: give the device access to ``fresh``, one call per run of adjacent pages
        and range (the native path grants each page id inside its one call)."""
        size, bases, OK = self.slice_bytes, self._bases, self._OK
        setaccess, access = self._d.cuMemSetAccess, self._access
        for _i, first, n in runs(fresh):
            start, length = first * size, n * size
            for base in bases:
                err = setaccess(base + start, length, access, 1)[0]
                if err != OK:
                    cut = done.index(first)
                    self._rollback(done, fresh, cut)
                    if err == self._OOM:
                        return done[:cut]
                    raise BackendError(f"cuMemSetAccess(pages {first}..{first + n - 1}) failed: {self._err_name(err)}")
        return done

    def _rollback(self, done: list[int], fresh: list[int], cut: int) -> None:
        """Undo ``map_pages`` for ``done[cut:]``: unmap what it mapped, and hand what it revived back
        to the unmapper."""
        undo = done[cut:]
        fresh_set = set(fresh)
        mapped_here = [p for p in undo if p in fresh_set]
        revived = [p for p in undo if p not in fresh_set]
        if mapped_here:
            self._unmap(mapped_here, keep=True)
        if revived:
            self._defer(revived)

    def _return(self, handles: list[Any]) -> None:
        """Put handles back into the pool, releasing what does not fit."""
        if not handles:
            return
        with self._lock:
            room = max(0, self.pool_pages * self.slices - len(self._pool))
            keep, drop = handles[:room], handles[room:]
            self._pool.extend(keep)
        if self._native is not None:
            err = self._native.release(drop)
            if err:
                raise BackendError(f"cuMemRelease failed: {self._err_name(err)}")
            self.released += len(drop)
            return
        release, OK = self._d.cuMemRelease, self._OK
        for h in drop:
            err = release(h)[0]
            if err != OK:
                raise BackendError(f"cuMemRelease failed: {self._err_name(err)}")
            self.released += 1

    def _unmap(self, pages: list[int], *, keep: bool) -> None:
        size, bases, OK, native = self.slice_bytes, self._bases, self._OK, self._native
        unmap = self._d.cuMemUnmap
        for _i, first, n in runs(pages):
            start, length = first * size, n * size
            errors: Iterable[Any]  # a generator on cuda-python: the first failure stops the unmaps
            if native is not None:
                errors = [native.unmap(start, length)]
            else:
                errors = (unmap(base + start, length)[0] for base in bases)
            for err in errors:
                if err != OK:
                    raise BackendError(f"cuMemUnmap(pages {first}..{first + n - 1}) failed: {self._err_name(err)}")
        handles: list[Any] = []
        for page in pages:
            handles += self._mapped.pop(page)
        if keep:
            self._return(handles)

    def _fence(self) -> Any:
        """An event recorded now on the stream the caller's kernels run on (see the module docstring)."""
        d = self._d
        torch = sys.modules.get("torch")
        stream: Any = getattr(d, "CU_STREAM_LEGACY", None) or d.CUstream(1)
        if torch is not None and torch.cuda.is_initialized():
            stream = d.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        with self._context():
            event = self._check("cuEventCreate", d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))
            try:
                self._check("cuEventRecord", d.cuEventRecord(event, stream))
            except BackendError:
                d.cuEventDestroy(event)
                raise
        return event

    def _wait_fences(self, wait: list[Any], done: list[Any]) -> None:
        """Wait for the events ``wait`` (the work queued before these pages were freed), then destroy ``done``."""
        d = self._d
        try:
            for event in wait:
                err = d.cuEventSynchronize(event)[0]
                if err != self._OK:
                    raise BackendError(f"cuEventSynchronize before an unmap failed: {self._err_name(err)}")
        finally:
            for event in done:
                d.cuEventDestroy(event)

    def _take_fences(self, pages: Iterable[int]) -> tuple[list[Any], list[Any]]:
        """The events the unmaps of ``pages`` wait for, and those of them no page still waiting shares
        (to destroy once waited for); the caller holds the lock."""
        mine = {id(e): e for e in (self._fences.pop(p, None) for p in pages) if e is not None}
        shared = {id(e) for e in self._fences.values()}
        return list(mine.values()), [e for key, e in mine.items() if key not in shared]

    # -- deferred unmapping ----------------------------------------------------------------------
    def _defer(self, pages: list[int]) -> None:
        due = time.monotonic() + self.unmap_delay_s
        fence = self._fence()
        with self._cv:
            for page in pages:
                self._pending[page] = due
                self._fences[page] = fence
            if self._unmapper is None:
                self._unmapper = threading.Thread(target=self._unmap_loop, name="kvc-cuda-unmap", daemon=True)
                self._unmapper.start()
            self._cv.notify_all()

    def _unmap_loop(self) -> None:
        """Unmap pages whose delay has passed, one page id at a time: a map that needs a page the
        unmapper holds waits for one page id's unmap, never for a batch."""
        while True:
            with self._cv:
                while True:
                    if not self._pending:
                        if self._stopping:
                            return
                        self._cv.wait()
                        continue
                    page, due = min(self._pending.items(), key=lambda item: item[1])
                    wait = due - time.monotonic()
                    if wait > 0 and not self._stopping:
                        self._cv.wait(wait)
                        continue
                    del self._pending[page]
                    self._busy.add(page)
                    break
            self._unmap_batch([page])

    def _take_pending(self) -> list[int]:
        batch = sorted(self._pending)
        self._pending.clear()
        self._busy.update(batch)
        return batch

    def _unmap_batch(self, batch: list[int]) -> None:
        try:
            with self._cv:
                wait, done = self._take_fences(batch)
            with self._context():
                self._wait_fences(wait, done)
                self._unmap(batch, keep=True)
        except BaseException as exc:  # noqa: BLE001 - reported to the next caller
            self._async_error = exc if isinstance(exc, BackendError) else BackendError(f"deferred unmap failed: {exc}")
        finally:
            with self._cv:
                self._busy.difference_update(batch)
                self._cv.notify_all()
        self._claimed()

    def _drain(self) -> None:
        """Finish every deferred unmap now (this thread does what is still queued)."""
        with self._cv:
            batch = self._take_pending() if self._pending else []
        if batch:
            self._unmap_batch(batch)
        with self._cv:
            while self._busy:
                self._cv.wait()
        self._raise_async()

    def _raise_async(self) -> None:
        exc, self._async_error = self._async_error, None
        if exc is not None:
            raise exc


class _CtxGuard:
    """Make the backend's primary context current for a call, restoring the caller's afterwards.

    Setting it for good would change which device torch thinks is current in that thread.
    """

    __slots__ = ("b", "pushed")

    def __init__(self, backend: PageMapping) -> None:
        self.b = backend
        self.pushed = False

    def __enter__(self) -> None:
        b = self.b
        res = b._d.cuCtxGetCurrent()
        if res[0] == b._OK and res[1] is not None and int(res[1]) == b._ctx_id:
            return
        b._check("cuCtxPushCurrent", b._d.cuCtxPushCurrent(b._ctx))
        self.pushed = True

    def __exit__(self, *exc: object) -> None:
        if self.pushed:
            self.b._d.cuCtxPopCurrent()


__all__ = ["PageMapping", "runs"]
