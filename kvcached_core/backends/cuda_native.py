"""Optional native loop for the CUDA backend's hot path, built with the system C compiler.

A layer-separated page id is dozens of driver calls. Made one by one from Python, each call
pays the interpreter's round trip, and on an H200 that measured +5 µs per physical handle
(+10-15 % on growth) although the bindings themselves take well under 1 µs: coming back to
the interpreter between calls is what costs. This module compiles a few-line C loop (no CUDA
headers: it receives the driver's entry points and cuda-python's own struct pointers) into a
cache directory once, loads it with ctypes, and lets the backend back every page id of a
``map_pages`` call in one call that also releases the GIL for its whole duration and makes the
backend's context current itself (a Python guard for that is one more binding round trip per
call, which the page layout's 30-60 µs page ids feel). Triton builds its launcher the same way.

``KVCACHED_CUDA_NATIVE``: ``auto`` (default: use it when it builds, in both layouts), ``0``
(never), ``1`` (always; the backend fails if it cannot be built). Without a compiler the backend
simply stays on cuda-python.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

from ..cbuild import build_extension, compile_c
from ..config import tristate_env

NATIVE_ENV = "KVCACHED_CUDA_NATIVE"

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>

typedef int (*create_t)(uint64_t *, size_t, const void *, unsigned long long);
typedef int (*map_t)(uint64_t, size_t, size_t, uint64_t, unsigned long long);
typedef int (*access_t)(uint64_t, size_t, const void *, size_t);
typedef int (*unmap_t)(uint64_t, size_t);
typedef int (*release_t)(uint64_t);
typedef int (*getcur_t)(void **);
typedef int (*push_t)(void *);
typedef int (*pop_t)(void **);

struct kvc_vmm {
    create_t create;
    map_t map;
    access_t access;
    unmap_t unmap;
    release_t release;
    const void *prop;   /* CUmemAllocationProp, owned by cuda-python */
    const void *desc;   /* one CUmemAccessDesc, owned by cuda-python */
    size_t size;        /* bytes per handle */
    size_t nbases;      /* handles per page id */
    const uint64_t *bases;
    getcur_t getcur;
    push_t push;
    pop_t pop;
    void *ctx;          /* the backend's primary context */
};

/* Make the backend's context current for one call, as CudaBackend's context guard does in
 * Python, without a round trip through the bindings: 0 when it is, else the driver's code. */
static int enter(const struct kvc_vmm *v, int *pushed) {
    void *cur = 0;
    *pushed = 0;
    if (v->getcur(&cur) == 0 && cur == v->ctx) return 0;
    int err = v->push(v->ctx);
    if (!err) *pushed = 1;
    return err;
}

static void leave(const struct kvc_vmm *v, int pushed) {
    void *ctx;
    if (pushed) v->pop(&ctx);
}

/* Create what the pool lacks and map handle s at bases[s] + offset, without access yet; on failure
 * nothing is left mapped and handles[0..*count) are valid. */
static int map_only(const struct kvc_vmm *v, size_t offset, uint64_t *handles, size_t have, size_t *count,
                    int *step) {
    size_t s;
    for (s = have; s < v->nbases; s++) {
        int err = v->create(&handles[s], v->size, v->prop, 0);
        if (err) {
            *count = s;
            *step = 1;
            return err;
        }
    }
    *count = v->nbases;
    for (s = 0; s < v->nbases; s++) {
        int err = v->map(v->bases[s] + offset, v->size, 0, handles[s], 0);
        if (err) {
            for (size_t k = 0; k < s; k++) v->unmap(v->bases[k] + offset, v->size);
            *step = 2;
            return err;
        }
    }
    return 0;
}

static int kvc_unmap_in(const struct kvc_vmm *v, size_t start, size_t length, size_t *failed) {
    size_t s;
    for (s = 0; s < v->nbases; s++) {
        int err = v->unmap(v->bases[s] + start, length);
        if (err) {
            *failed = s;
            return err;
        }
    }
    return 0;
}

static int kvc_release_in(const struct kvc_vmm *v, const uint64_t *handles, size_t n, size_t *failed) {
    size_t i;
    for (i = 0; i < n; i++) {
        int err = v->release(handles[i]);
        if (err) {
            *failed = i;
            return err;
        }
    }
    return 0;
}

/* Back npages page ids (at offsets[i]) in one call, in the order a C program would: create and map
 * every handle, then one cuMemSetAccess per run of adjacent page ids and range (as the floor in
 * benchmarks/native/vmm_floor.c and the cuda-python path do). handles has npages * nbases slots,
 * the first `have` from the pool. On failure returns the driver's code and *step: 1 create, 2 map,
 * 3 access, 4 making the context current. The first *done page ids are backed, and
 * handles[*done * nbases .. *end) are valid and unmapped. */
int kvc_map_pages(const struct kvc_vmm *v, const uint64_t *offsets, size_t npages, uint64_t *handles, size_t have,
                  size_t *done, size_t *end, int *step) {
    size_t nb = v->nbases, mapped = 0, count = 0, i, j, k, s;
    int pushed, err = enter(v, &pushed);
    *done = 0;
    if (err) {
        *end = have;
        *step = 4;
        return err;
    }
    for (i = 0; i < npages; i++) {
        size_t first = i * nb, mine = 0;
        if (have > first) mine = have - first < nb ? have - first : nb;
        err = map_only(v, offsets[i], handles + first, mine, &count, step);
        if (err) break;
        mapped = i + 1;
    }
    *end = mapped * nb;
    if (err) *end = mapped * nb + count > have ? mapped * nb + count : have;
    for (i = 0; i < mapped; i = j) {
        for (j = i + 1; j < mapped && offsets[j] == offsets[j - 1] + v->size; j++) {
        }
        for (s = 0; s < nb; s++) {
            int aerr = v->access(v->bases[s] + offsets[i], (j - i) * v->size, v->desc, 1);
            if (aerr) {  /* the pages from this run on are mapped without access: take them back */
                for (k = i; k < mapped; k++)
                    for (size_t r = 0; r < nb; r++) v->unmap(v->bases[r] + offsets[k], v->size);
                *end = *end > mapped * nb ? *end : mapped * nb;
                *step = 3;
                leave(v, pushed);
                return aerr;
            }
        }
        *done = j;
    }
    leave(v, pushed);
    return err;
}

int kvc_unmap(const struct kvc_vmm *v, size_t start, size_t length, size_t *failed) {
    int pushed, err = enter(v, &pushed);
    if (err) return err;
    err = kvc_unmap_in(v, start, length, failed);
    leave(v, pushed);
    return err;
}

int kvc_release(const struct kvc_vmm *v, const uint64_t *handles, size_t n, size_t *failed) {
    int pushed, err = enter(v, &pushed);
    if (err) return err;
    err = kvc_release_in(v, handles, n, failed);
    leave(v, pushed);
    return err;
}
"""


# A CPython extension that calls kvc_map_pages (by address, in the library above) with Python lists.
# Through ctypes, the call's argument conversions, scratch arrays and result slicing were most of the
# 8-11 µs a one-page-id map_pages call spent outside the driver on the H200 VM, which a 30-60 µs
# page-layout page id feels (benchmarks/vmm.py, page layout, batch 1).
CALLER_SOURCE = r"""#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*map_pages_t)(const void *, const uint64_t *, size_t, uint64_t *, size_t, size_t *, size_t *, int *);

static int fill(PyObject *list, uint64_t *dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        dst[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(list, i));
        if (dst[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *handle_list(const uint64_t *h, size_t from, size_t to) {
    PyObject *list = PyList_New(to > from ? (Py_ssize_t)(to - from) : 0);
    for (size_t i = from; list && i < to; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(h[i]);
        if (!o) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)(i - from), o);
    }
    return list;
}

/* map_pages(fn, vmm, offsets, pooled, slices) -> (err, step, done, handles, spare), as
 * NativeVmm.map_pages; the driver work runs without the GIL. */
static PyObject *map_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "map_pages(fn, vmm, offsets: list, pooled: list, slices)");
        return NULL;
    }
    map_pages_t fn = (map_pages_t)PyLong_AsVoidPtr(args[0]);
    if (!fn && PyErr_Occurred()) return NULL;
    const void *vmm = PyLong_AsVoidPtr(args[1]);
    if (!vmm && PyErr_Occurred()) return NULL;
    size_t slices = PyLong_AsSize_t(args[4]);
    if (slices == (size_t)-1 && PyErr_Occurred()) return NULL;
    if (!fn || !vmm || !slices) {
        PyErr_SetString(PyExc_ValueError, "map_pages: null function, null vmm or no slices");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[2]), have = PyList_GET_SIZE(args[3]);
    if ((size_t)have > (size_t)n * slices) {
        PyErr_SetString(PyExc_ValueError, "map_pages: more pooled handles than the page ids take");
        return NULL;
    }
    uint64_t stack[80], *mem = stack;
    size_t need = (size_t)n + (size_t)n * slices;
    if (need > sizeof stack / sizeof stack[0] && !(mem = PyMem_Malloc(need * sizeof(uint64_t)))) return PyErr_NoMemory();
    uint64_t *offsets = mem, *handles = mem + n;
    PyObject *result = NULL;
    if (fill(args[2], offsets, n) == 0 && fill(args[3], handles, have) == 0) {
        size_t done = 0, end = 0;
        int step = 0, err;
        Py_BEGIN_ALLOW_THREADS
        err = fn(vmm, offsets, (size_t)n, handles, (size_t)have, &done, &end, &step);
        Py_END_ALLOW_THREADS
        size_t backed = err ? done * slices : (size_t)n * slices;
        PyObject *got = handle_list(handles, 0, backed), *spare = NULL;
        if (got) spare = err ? handle_list(handles, backed, end) : PyList_New(0);
        if (got && spare) {
            result = Py_BuildValue("(iinNN)", err, err ? step : 0, err ? (Py_ssize_t)done : n, got, spare);
        } else {
            Py_XDECREF(got);
            Py_XDECREF(spare);
        }
    }
    if (mem != stack) PyMem_Free(mem);
    return result;
}

static PyMethodDef methods[] = {
    {"map_pages", (PyCFunction)(void (*)(void))map_pages, METH_FASTCALL, "kvc_map_pages with Python lists"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_kvc_vmmcall", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__kvc_vmmcall(void) { return PyModule_Create(&module); }
"""


def native_mode_from_env() -> str:
    return tristate_env(NATIVE_ENV)


def build() -> tuple[Path | None, str]:
    """The compiled helper (built once per source and machine), or None and why not."""
    return compile_c(SOURCE, "vmm")


class _Vmm(ctypes.Structure):
    _fields_ = [("create", ctypes.c_void_p), ("map", ctypes.c_void_p), ("access", ctypes.c_void_p),
                ("unmap", ctypes.c_void_p), ("release", ctypes.c_void_p), ("prop", ctypes.c_void_p),
                ("desc", ctypes.c_void_p), ("size", ctypes.c_size_t), ("nbases", ctypes.c_size_t),
                ("bases", ctypes.POINTER(ctypes.c_uint64)), ("getcur", ctypes.c_void_p), ("push", ctypes.c_void_p),
                ("pop", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _Scratch:
    """One thread's argument buffers: out-parameters and arrays for ``pages`` page ids."""

    __slots__ = ("pages", "offsets", "handles", "done", "count", "step", "done_ref", "count_ref", "step_ref")

    def __init__(self, pages: int, slices: int) -> None:
        self.pages = pages
        self.offsets = (ctypes.c_uint64 * pages)()
        self.handles = (ctypes.c_uint64 * (pages * slices))()
        self.done, self.count, self.step = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_int()
        self.done_ref, self.count_ref, self.step_ref = ctypes.byref(self.done), ctypes.byref(self.count), \
            ctypes.byref(self.step)


class NativeVmm:
    """The compiled loop bound to one backend's ranges (handles are plain ints here)."""

    def __init__(self, path: Path, prop: Any, access: Any, slice_bytes: int, bases: list[int], ctx: int) -> None:
        self.lib = ctypes.CDLL(str(path))
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
        self._ref = ctypes.byref(vmm)
        self._slices = len(bases)
        self._tls = threading.local()  # per-thread out-parameters: the refill and unmap threads overlap
        lib = self.lib
        vmm_p, size, u64_p = ctypes.POINTER(_Vmm), ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)
        size_p, int_p = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)
        # Declared argument types let ctypes convert plain ints itself (no c_size_t objects per call).
        for name, args in (("kvc_map_pages", [vmm_p, u64_p, size, u64_p, size, size_p, size_p, int_p]),
                           ("kvc_unmap", [vmm_p, size, size, size_p]),
                           ("kvc_release", [vmm_p, u64_p, size, size_p])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, args
        self._map_pages = lib.kvc_map_pages
        self._unmap = lib.kvc_unmap
        self._release = lib.kvc_release
        caller, self.caller_reason = build_extension(CALLER_SOURCE, "_kvc_vmmcall")
        self._caller = caller.map_pages if caller is not None else None  # else through ctypes, below
        self._call_args = (ctypes.cast(lib.kvc_map_pages, ctypes.c_void_p).value, ctypes.addressof(vmm))

    def _scratch(self, pages: int = 1) -> _Scratch:
        """This thread's arguments for the C calls (the refill and unmap threads call concurrently),
        grown to hold ``pages`` page ids."""
        scratch = getattr(self._tls, "scratch", None)
        if scratch is None or scratch.pages < pages:
            self._tls.scratch = scratch = _Scratch(max(pages, 8), self._slices)
        return scratch

    def map_pages(self, offsets: list[int], pooled: list[int]) -> tuple[int, int, int, list[int], list[int]]:
        """Back several page ids in one call: (error, step, page ids done, their handles, spare handles).

        ``step``: 1 = create, 2 = map, 3 = access, 4 = making the context current failed; the spare
        handles are valid and unmapped (the pool's again)."""
        if self._caller is not None:
            return self._caller(*self._call_args, offsets, pooled, self._slices)
        n, have = len(offsets), len(pooled)
        sc = self._scratch(n)
        handles = sc.handles
        sc.offsets[:n] = offsets
        if have:
            handles[:have] = pooled
        err = self._map_pages(self._ref, sc.offsets, n, handles, have, sc.done_ref, sc.count_ref, sc.step_ref)
        if not err:
            return 0, 0, n, handles[:n * self._slices], []
        mapped = sc.done.value * self._slices
        return err, sc.step.value, sc.done.value, handles[:mapped], handles[mapped:sc.count.value]

    def unmap(self, start: int, length: int) -> int:
        return self._unmap(self._ref, start, length, self._scratch().count_ref)

    def release(self, handles: list[int]) -> int:
        if not handles:
            return 0
        arr = (ctypes.c_uint64 * len(handles))(*handles)
        return self._release(self._ref, arr, len(handles), self._scratch().count_ref)


__all__ = ["NATIVE_ENV", "NativeVmm", "build", "native_mode_from_env"]
