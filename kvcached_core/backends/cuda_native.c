/* The CUDA backend's map loop (kvcached_core/backends/cuda_native.py says why it exists).
 *
 * No CUDA headers: it receives the driver's entry points and cuda-python's own struct pointers in a
 * struct kvc_vmm that cuda_native.py fills. Built when the package is installed (setup.py), as the
 * optional extension kvcached_core.backends._cuda_native; without it the backend stays on cuda-python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
static int kvc_map_pages(const struct kvc_vmm *v, const uint64_t *offsets, size_t npages, uint64_t *handles, size_t have,
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

static int kvc_unmap(const struct kvc_vmm *v, size_t start, size_t length, size_t *failed) {
    int pushed, err = enter(v, &pushed);
    if (err) return err;
    err = kvc_unmap_in(v, start, length, failed);
    leave(v, pushed);
    return err;
}

static int kvc_release(const struct kvc_vmm *v, const uint64_t *handles, size_t n, size_t *failed) {
    int pushed, err = enter(v, &pushed);
    if (err) return err;
    err = kvc_release_in(v, handles, n, failed);
    leave(v, pushed);
    return err;
}

/* -- the Python entry points ------------------------------------------------------------ */
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

static const struct kvc_vmm *vmm_arg(PyObject *arg) {
    const struct kvc_vmm *v = PyLong_AsVoidPtr(arg);
    if (!v && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null vmm");
    return v;
}

/* map_pages(vmm, offsets, pooled) -> (err, step, done, handles, spare), as NativeVmm.map_pages
 * (vmm's nbases handles per page id); the driver work runs without the GIL. */
static PyObject *map_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "map_pages(vmm, offsets: list, pooled: list)");
        return NULL;
    }
    const struct kvc_vmm *vmm = vmm_arg(args[0]);
    if (!vmm) return NULL;
    size_t slices = vmm->nbases;
    if (!slices) {
        PyErr_SetString(PyExc_ValueError, "map_pages: the vmm has no ranges");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[1]), have = PyList_GET_SIZE(args[2]);
    if ((size_t)have > (size_t)n * slices) {
        PyErr_SetString(PyExc_ValueError, "map_pages: more pooled handles than the page ids take");
        return NULL;
    }
    uint64_t stack[80], *mem = stack;
    size_t need = (size_t)n + (size_t)n * slices;
    if (need > sizeof stack / sizeof stack[0] && !(mem = PyMem_Malloc(need * sizeof(uint64_t)))) return PyErr_NoMemory();
    uint64_t *offsets = mem, *handles = mem + n;
    PyObject *result = NULL;
    if (fill(args[1], offsets, n) == 0 && fill(args[2], handles, have) == 0) {
        size_t done = 0, end = 0;
        int step = 0, err;
        Py_BEGIN_ALLOW_THREADS
        err = kvc_map_pages(vmm, offsets, (size_t)n, handles, (size_t)have, &done, &end, &step);
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

/* unmap(vmm, start, length) -> err: every range's [start, start + length), without the GIL. */
static PyObject *unmap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "unmap(vmm, start, length)");
        return NULL;
    }
    const struct kvc_vmm *vmm = vmm_arg(args[0]);
    if (!vmm) return NULL;
    size_t start = PyLong_AsSize_t(args[1]), length = PyLong_AsSize_t(args[2]), failed = 0;
    if (PyErr_Occurred()) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = kvc_unmap(vmm, start, length, &failed);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* release(vmm, handles: list) -> err, without the GIL. */
static PyObject *release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "release(vmm, handles: list)");
        return NULL;
    }
    const struct kvc_vmm *vmm = vmm_arg(args[0]);
    if (!vmm) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(args[1]);
    uint64_t *handles = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(uint64_t));
    if (!handles) return PyErr_NoMemory();
    size_t failed = 0;
    int err = 0;
    if (fill(args[1], handles, n) < 0) {
        PyMem_Free(handles);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    err = kvc_release(vmm, handles, (size_t)n, &failed);
    Py_END_ALLOW_THREADS
    PyMem_Free(handles);
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"map_pages", (PyCFunction)(void (*)(void))map_pages, METH_FASTCALL, "back several page ids in one call"},
    {"unmap", (PyCFunction)(void (*)(void))unmap, METH_FASTCALL, "unmap a span of every range"},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL, "release physical handles"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvcached_core.backends._cuda_native", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cuda_native(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef KVC_SOURCE_DIGEST
    if (m && PyModule_AddStringConstant(m, "SOURCE_DIGEST", KVC_SOURCE_DIGEST) < 0) Py_CLEAR(m);
#endif
    return m;
}
