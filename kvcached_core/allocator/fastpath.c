/* The allocator's hot path in C: alloc (placement plus the segment publish that follows it) and free.
 *
 * It mirrors kvcached_core/allocator/placement.py (Policy.place, Affinity.place, FirstFit.place,
 * place_draining), pages.py (take_blocks, best_fit, emptiest, lowest_open, free_blocks) and manager.py
 * (free, _release_blocks, _publish) step for step, on the very same Python objects (the page table's
 * lists and sets, the segment's mapping): there is one state, the Python code is the reference and
 * the path without a compiler, and either path may run at any time. tests/test_fastpath.py checks
 * that both produce the same blocks and the same segment bytes. Which attributes it works on is
 * fastpath.py's BINDING, passed in as ``names`` (FIELD_ROLES and OBJECT_ROLES below list the roles it
 * needs); where the segment keeps what it writes, SegmentWriter.c_offsets. The interpreter's dispatch is
 * what this removes (benchmarks/probes/tight_alloc.py compares the two paths).
 *
 * The parts it mirrors are under fastpath_c/, one header each, all in this one compilation unit: common.h,
 * pages.h (the page table), placement.h, publish.h; this file holds alloc, free and the module's glue.
 *
 * Built when the package is installed (setup.py), as the optional extension kvcached_core.allocator._fastpath;
 * without it the allocator stays on the Python path and says so once.
 */
#include "fastpath_c/common.h"
#include "fastpath_c/pages.h"
#include "fastpath_c/placement.h"
#include "fastpath_c/publish.h"


/* alloc(n, near) -> list of block ids, or None when pages ran out (the blocks taken were given
 * back through the manager's _release_blocks; the caller publishes and reports). The caller holds
 * the manager's lock and has checked the fast path applies (open). */
static PyObject *FastPath_alloc(FastPath *f, PyObject *const *args, Py_ssize_t nargs) {
    long n, near = -1;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "alloc(n, near) takes two arguments");
        return NULL;
    }
    PyObject *near_obj = args[1];
    int overflow;
    n = PyLong_AsLongAndOverflow(args[0], &overflow);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (overflow < 0 || (!overflow && n <= 0)) return PyList_New(0);
    if (overflow > 0 || n > (long)f->nblocks) n = (long)f->nblocks + 1; /* more than there is: a miss */
    if (near_obj != Py_None) {
        near = PyLong_AsLongAndOverflow(near_obj, &overflow);
        if (near == -1 && PyErr_Occurred()) return NULL;
        if (overflow || near < 0) near = -1; /* no such block: a hint to ignore, as in Python */
    }
    STAMP(0);
    if (load_state(f) < 0) return NULL;
    STAMP(1);
    Ids taken = {.v = NULL, .n = 0, .cap = 128};
    taken.v = taken.stack;
    PyObject *list = NULL;
    long status;
    int ok;
    if (get_long_attr(f->mgr_d, f->n[R_limit_status], &status) < 0) ok = -1;
    else if (status == f->limit_deferred) ok = place_draining(f, n, &taken); /* manager._place */
    else if (f->policy == POLICY_FIRST_FIT) ok = place_first_fit(f, n, &taken);
    else if (f->policy == POLICY_AFFINITY && near_obj != Py_None) ok = place_affinity(f, n, near, &taken);
    else ok = place_best_fit(f, n, &taken);
    STAMP(2);
    if (store_state(f) < 0) ok = -1;
    if (ok < 0) goto fail;
    STAMP(3);
    list = ids_list(f, &taken);
    if (!list) goto fail;
    STAMP(4);
    if (!ok) {
        PyObject *r = PyObject_CallOneArg(f->release_blocks, list);
        Py_DECREF(list);
        ids_free(&taken);
        if (!r) return NULL;
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    long count, blocks;
    if (get_long_attr(f->mgr_d, f->n[R_alloc_count], &count) < 0 || get_long_attr(f->mgr_d, f->n[R_alloc_blocks], &blocks) < 0)
        goto fail;
    if (set_long_attr(f->mgr_d, f->n[R_alloc_count], count + 1) < 0 || set_long_attr(f->mgr_d, f->n[R_alloc_blocks], blocks + n) < 0)
        goto fail;
    STAMP(5);
    if (publish(f, f->o_alloc_count, count + 1, f->o_alloc_blocks, blocks + n, NULL) < 0) goto fail;
    STAMP(9);
    ids_free(&taken);
    return list;
fail:
    Py_XDECREF(list);
    ids_free(&taken);
    return NULL;
}

/* Release the manager's lock, keeping any exception already raised. */
static PyObject *unlock(FastPath *f, PyObject *result) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(f->lock_release);
    if (!r) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(type, value, tb);
    return result;
}

/* Ask the refill thread for pages when the pool ran low (the tail of KVCacheManager.alloc). */
static int request_refill(FastPath *f) {
    long inflight, min_reserved;
    if (get_long_attr(f->pages_d, f->n[R_inflight], &inflight) < 0 || get_long_attr(f->mgr_d, f->n[R_min_reserved], &min_reserved) < 0)
        return -1;
    if (PyList_GET_SIZE(f->reserved) + inflight >= min_reserved) return 0;
    if (PyDict_SetItem(f->mgr_d, f->n[R_refill_requested], Py_True) < 0) return -1;
    PyObject *polling = PyDict_GetItemWithError(f->mgr_d, f->n[R_refill_polling]);
    if (!polling && PyErr_Occurred()) return -1;
    if (polling == Py_True) return 0;
    PyObject *r = PyObject_CallNoArgs(f->refill_notify);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* manager_alloc(n, *, near=None): all of KVCacheManager.alloc in one call, installed as the
 * manager's `alloc`. Right after an engine's GPU wait the Python around the C placement cost
 * more than the placement itself (benchmarks/probes/alloc_stages.py); here it is a few C calls.
 * Whatever the fast path does not serve (a closed manager, arguments that are
 * not plain ints) goes to the Python method, which is the reference. */
static PyObject *FastPath_manager_alloc(FastPath *f, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *near = Py_None;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs != 1 || nkw > 1 || (nkw == 1 && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), S_near) != 0))
        return PyObject_Vectorcall(f->py_alloc, args, nargs, kwnames);
    if (nkw) near = args[1];
    if (!PyLong_CheckExact(args[0]) || (near != Py_None && !PyLong_CheckExact(near)))
        return PyObject_Vectorcall(f->py_alloc, args, nargs, kwnames);
    int overflow;
    long n = PyLong_AsLongAndOverflow(args[0], &overflow);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (overflow < 0 || (!overflow && n <= 0)) return PyList_New(0);
    PyObject *r = PyObject_CallNoArgs(f->lock_acquire);
    if (!r) return NULL;
    Py_DECREF(r);
    PyObject *closed = PyDict_GetItemWithError(f->mgr_d, f->n[R_closed]);
    if (!closed && PyErr_Occurred()) return unlock(f, NULL);
    if (closed != Py_False) { /* the Python method raises what a closed allocator raises */
        PyObject *done = unlock(f, Py_NewRef(Py_None));
        if (!done) return NULL;
        Py_DECREF(done);
        return PyObject_Vectorcall(f->py_alloc, args, nargs, kwnames);
    }
    PyObject *error = PyDict_GetItemWithError(f->mgr_d, f->n[R_map_error]);
    if ((!error && PyErr_Occurred()) || (error != Py_None && PyDict_SetItem(f->mgr_d, f->n[R_map_error], Py_None) < 0))
        return unlock(f, NULL);
    PyObject *inner[2] = {args[0], near};
    PyObject *ids = FastPath_alloc(f, inner, 2);
    if (!ids) return unlock(f, NULL);
    if (ids == Py_None) {
        Py_DECREF(ids);
        return unlock(f, PyObject_CallOneArg(f->alloc_missed, args[0]));
    }
    if (request_refill(f) < 0) {
        Py_DECREF(ids);
        return unlock(f, NULL);
    }
    return unlock(f, ids);
}

/* Call a manager method for its effect: 0, or -1 with its exception. */
static int call0(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* free(ids) -> True when done, False when an id is not a plain int (the caller's Python path takes
 * those). Mirrors manager.free: _validate_used, the prefix-cache removals, PageTable.free_blocks and
 * _release_blocks, the counters and the publish. Anything beyond the page table (a cache removal, an
 * unmap, a limit's status) goes through the manager's own methods, and then the full publish. */
static PyObject *FastPath_free(FastPath *f, PyObject *ids) {
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "free(ids) takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids), i;
    char *flags = PyByteArray_AS_STRING(f->block_used);
    for (i = 0; i < n; i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(ids, i))) Py_RETURN_FALSE;
    /* validate: each allocated, none twice (a seen block is marked 2 until the check ends) */
    for (i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ids, i);
        long block = PyLong_AsLong(item);
        if (block == -1 && PyErr_Occurred()) PyErr_Clear();
        if (block < 0 || block >= (long)f->nblocks || flags[block] != 1) {
            for (Py_ssize_t k = 0; k < i; k++) flags[PyLong_AsLong(PyList_GET_ITEM(ids, k))] = 1;
            PyErr_Format(PyExc_ValueError, "block %R is not allocated (or listed twice); nothing was changed", item);
            return NULL;
        }
        flags[block] = 2;
    }
    for (i = 0; i < n; i++) flags[PyLong_AsLong(PyList_GET_ITEM(ids, i))] = 1;
    int slow_publish = 0;
    PyObject *cached = PyObject_GetAttr(f->cache, f->n[R_blocks]); /* the prefix cache: block -> age */
    if (!cached) return NULL;
    if (PyDict_Check(cached) && PyDict_GET_SIZE(cached)) {
        for (i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(ids, i);
            int has = PyDict_Contains(cached, item);
            PyObject *r = has > 0 ? PyObject_CallOneArg(f->cache_remove, item) : NULL;
            if (has < 0 || (has > 0 && !r)) {
                Py_DECREF(cached);
                return NULL;
            }
            Py_XDECREF(r);
            slow_publish |= has;
        }
    }
    Py_DECREF(cached);
    if (load_state(f) < 0) return NULL; /* the publish below reads these too */
    if (n) {
        /* PageTable.free_blocks */
        long bpp = (long)f->bpp;
        Ids order = {.v = NULL, .n = 0, .cap = 128};
        order.v = order.stack;
        for (i = 0; i < n; i++) {
            long block = PyLong_AsLong(PyList_GET_ITEM(ids, i)), page = block / bpp;
            flags[block] = 0;
            PyObject *slot = PyLong_FromLong(block - page * bpp);
            if (!slot || PyList_Append(PyList_GET_ITEM(f->slots, page), slot) < 0) {
                Py_XDECREF(slot);
                ids_free(&order);
                return NULL;
            }
            Py_DECREF(slot);
            if (f->counts[page]++ == 0 && ids_push(&order, page) < 0) {
                ids_free(&order);
                return NULL;
            }
        }
        int failed = 0;
        for (i = 0; i < order.n && !failed; i++) {
            long page = order.v[i], count = f->counts[page];
            long before = list_long(f->used, page), cap = list_long(f->cap, page);
            PyObject *pobj = page_object(f, page);
            if (!pobj) {
                failed = 1;
                break;
            }
            if (before != cap && unlist(f, pobj, cap - before) < 0) failed = 1;
            if (!failed && list_set_long(f->used, page, before - count) < 0) failed = 1;
            if (!failed) {
                if (before == count) f->inuse--;
                else if (enlist(f, pobj, cap - before + count) < 0) failed = 1;
            }
            if (!failed && PySet_Add(f->touched, pobj) < 0) failed = 1;
            Py_DECREF(pobj);
        }
        f->blocks_used -= (long)n;
        for (i = 0; i < order.n; i++) f->counts[order.v[i]] = 0;
        if (failed || store_state(f) < 0) {
            ids_free(&order);
            return NULL;
        }
        /* manager._release_blocks: pages that emptied join the pool, or go when it is full or over the limit */
        for (i = 0; i < order.n; i++) {
            long page = order.v[i];
            if (list_long(f->used, page) != 0) continue;
            PyObject *pobj = page_object(f, page);
            if (!pobj || PyList_Append(f->reserved, pobj) < 0) {
                Py_XDECREF(pobj);
                ids_free(&order);
                return NULL;
            }
            Py_DECREF(pobj);
            long max_reserved, inflight, limit = -1, status;
            PyObject *limit_obj = PyDict_GetItemWithError(f->mgr_d, f->n[R_limit_pages]);
            if ((!limit_obj && PyErr_Occurred()) || get_long_attr(f->mgr_d, f->n[R_max_reserved], &max_reserved) < 0 ||
                get_long_attr(f->pages_d, f->n[R_inflight], &inflight) < 0 ||
                get_long_attr(f->mgr_d, f->n[R_limit_status], &status) < 0) {
                ids_free(&order);
                return NULL;
            }
            if (limit_obj && limit_obj != Py_None) limit = PyLong_AsLong(limit_obj);
            Py_ssize_t pool = PyList_GET_SIZE(f->reserved);
            int over_limit = limit >= 0 && f->inuse + pool + inflight > limit;
            int overflow = over_limit || pool > max_reserved, deferred = status == f->limit_deferred;
            if ((overflow && call0(f->pool_overflow) < 0) || (deferred && call0(f->update_limit) < 0) ||
                ((overflow || deferred) && load_state(f) < 0)) {  /* the manager changed the page table */
                ids_free(&order);
                return NULL;
            }
            slow_publish |= overflow || deferred;
        }
        ids_free(&order);
    }
    long count, blocks;
    if (get_long_attr(f->mgr_d, f->n[R_free_count], &count) < 0 || get_long_attr(f->mgr_d, f->n[R_free_blocks], &blocks) < 0 ||
        set_long_attr(f->mgr_d, f->n[R_free_count], count + 1) < 0 || set_long_attr(f->mgr_d, f->n[R_free_blocks], blocks + n) < 0)
        return NULL;
    if (slow_publish) {
        if (call0(f->publish_all) < 0) return NULL;
    } else if (publish(f, f->o_free_count, count + 1, f->o_free_blocks, blocks + n, NULL) < 0) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* publish() -> None: all of manager._publish (the caller holds its lock).
 * The manager calls this instead of its Python publish once the C path is attached: the same bytes
 * (tests/test_fastpath.py), without the interpreter inside the seqlock window. */
static PyObject *FastPath_publish(FastPath *f, PyObject *Py_UNUSED(unused)) {
    Full full;
    if (get_long_attr(f->pages_d, f->n[R_pages_inuse], &f->inuse) < 0 || get_long_attr(f->pages_d, f->n[R_blocks_used], &f->blocks_used) < 0 ||
        read_full(f, &full) < 0)
        return NULL;
    if (publish(f, 0, 0, 0, 0, &full) < 0) return NULL;
    Py_RETURN_NONE;
}

/* obj's attribute that plays ``role`` (BINDING names it), a new reference; NULL with an exception. */
static PyObject *role_attr(PyObject *names, PyObject *obj, const char *role) {
    PyObject *name = PyDict_GetItemString(names, role); /* borrowed */
    if (!name || !PyUnicode_Check(name)) {
        PyErr_Format(PyExc_KeyError, "the fast path's binding names no attribute for %s (fastpath.BINDING)", role);
        return NULL;
    }
    return PyObject_GetAttr(obj, name);
}

static int FastPath_init(FastPath *f, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"manager", "policy", "slack", "offsets", "names", NULL};
    PyObject *mgr, *offsets, *names;
    int policy;
    double slack;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OidO!O!", kwlist, &mgr, &policy, &slack, &PyDict_Type, &offsets,
                                     &PyDict_Type, &names))
        return -1;
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *name = PyDict_GetItemString(names, FIELD_ROLE_NAMES[i]);
        if (!name || !PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_KeyError, "the fast path's binding names no attribute for %s (fastpath.BINDING)",
                         FIELD_ROLE_NAMES[i]);
            return -1;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name); /* dict lookups by identity, as for the instance dicts' own keys */
        Py_XSETREF(f->n[i], name);
    }
    f->mgr = Py_NewRef(mgr);
    if (policy != POLICY_BEST_FIT && policy != POLICY_AFFINITY && policy != POLICY_FIRST_FIT) {
        PyErr_Format(PyExc_ValueError, "unknown placement policy code %d (fastpath.POLICY_*)", policy);
        return -1;
    }
    f->policy = policy;
    f->slack = slack;
    if (!(f->pages = role_attr(names, mgr, "pages")) || !(f->cache = role_attr(names, mgr, "cache")) ||
        !(f->seg = role_attr(names, mgr, "segment")))
        return -1;
    if (!(f->view = role_attr(names, f->seg, "buf"))) return -1;
    if (!(f->mgr_d = PyObject_GetAttrString(mgr, "__dict__")) ||
        !(f->pages_d = PyObject_GetAttrString(f->pages, "__dict__")) ||
        !(f->seg_d = PyObject_GetAttrString(f->seg, "__dict__")))
        return -1;
    if (!PyDict_Check(f->mgr_d) || !PyDict_Check(f->pages_d) || !PyDict_Check(f->seg_d)) {
        PyErr_SetString(PyExc_TypeError, "the fast path needs plain instance dictionaries");
        return -1;
    }
    if (!(f->used = role_attr(names, f->pages, "used")) || !(f->cap = role_attr(names, f->pages, "cap")) ||
        !(f->slots = role_attr(names, f->pages, "slots")) || !(f->partial = role_attr(names, f->pages, "partial")) ||
        !(f->reserved = role_attr(names, f->pages, "reserved")) ||
        !(f->block_used = role_attr(names, f->pages, "block_used")) ||
        !(f->touched = role_attr(names, f->pages, "touched")) || !(f->mapped = role_attr(names, f->pages, "mapped")))
        return -1;
    if (!PyList_Check(f->used) || !PyList_Check(f->cap) || !PyList_Check(f->slots) || !PyList_Check(f->partial) ||
        !PyList_Check(f->reserved) || !PyByteArray_Check(f->block_used) || !PySet_Check(f->touched) ||
        !PyByteArray_Check(f->mapped)) {
        PyErr_SetString(PyExc_TypeError, "the page table's containers are not the types the fast path reads");
        return -1;
    }
    if (!(f->empty_page = role_attr(names, mgr, "empty_page")) ||
        !(f->release_blocks = role_attr(names, mgr, "release_blocks")) ||
        !(f->pool_overflow = role_attr(names, mgr, "pool_overflow")) ||
        !(f->update_limit = role_attr(names, mgr, "update_limit_status")) ||
        !(f->publish_all = role_attr(names, mgr, "publish")) || !(f->cache_remove = role_attr(names, f->cache, "remove")) ||
        !(f->alloc_missed = role_attr(names, mgr, "alloc_missed")))
        return -1;
    /* manager_alloc's lock, refill wake-up and fallback, bound once here as the callbacks above
     * are: replacing them on the instance later does not reach the C entry. */
    PyObject *lock = NULL, *wanted = NULL, *method = NULL;
    int bound = (lock = role_attr(names, mgr, "lock")) && (wanted = role_attr(names, mgr, "refill_wanted")) &&
                (method = PyObject_GetAttrString((PyObject *)Py_TYPE(mgr), "alloc")) &&
                (f->lock_acquire = PyObject_GetAttrString(lock, "acquire")) &&
                (f->lock_release = PyObject_GetAttrString(lock, "release")) &&
                (f->refill_notify = PyObject_GetAttrString(wanted, "notify")) && (f->py_alloc = PyMethod_New(method, mgr));
    Py_XDECREF(lock);
    Py_XDECREF(wanted);
    Py_XDECREF(method);
    if (!bound) return -1;
    if (!(f->counts = PyMem_Calloc(PyList_GET_SIZE(f->used) + 1, sizeof(long))) ||
        !(f->pagecache = PyMem_Calloc(PyList_GET_SIZE(f->used) + 1, sizeof(PyObject *)))) {
        f->npages = 0;
        PyErr_NoMemory();
        return -1;
    }
    f->npages = PyList_GET_SIZE(f->used);
    PyObject *bpp = role_attr(names, f->pages, "bpp");
    if (!bpp) return -1;
    f->bpp = PyLong_AsSsize_t(bpp);
    Py_DECREF(bpp);
    if (f->bpp <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "blocks per page must be positive");
        return -1;
    }
    f->nblocks = PyByteArray_GET_SIZE(f->block_used);
    f->idcache = PyMem_Calloc(f->nblocks ? f->nblocks : 1, sizeof(PyObject *));
    if (!f->idcache) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyList_GET_SIZE(f->partial) != f->bpp + 1) {
        PyErr_SetString(PyExc_ValueError, "the page table's buckets do not match its blocks per page");
        return -1;
    }
    long long tp_world = 1;
    struct { const char *key; Py_ssize_t *dst; } fields[] = {
        {"seq", &f->seq_off}, {"counters", &f->counters_off}, {"counters_len", &f->counters_len},
        {"checksum", &f->checksum_off}, {"page_map", &f->page_map_off}, {"pages_inuse", &f->o_inuse},
        {"pages_reserved", &f->o_reserved}, {"blocks_used", &f->o_blocks_used}, {"mapped_bytes", &f->o_mapped},
        {"alloc_count", &f->o_alloc_count}, {"alloc_blocks", &f->o_alloc_blocks}, {"updated_ns", &f->o_updated},
        {"free_count", &f->o_free_count}, {"free_blocks", &f->o_free_blocks},
        {"page_sum", &f->o_page_sum}, {"cached_shift", NULL}, {"page_mapped", NULL}, {"bundle_bytes", NULL},
        {"limit_deferred", NULL}, {"ranks", &f->ranks_off}, {"rank_size", &f->rank_size},
        {"ranks_max", &f->ranks_max}, {"rank_rank", &f->o_rank[0]}, {"rank_device", &f->o_rank[1]},
        {"rank_pid", &f->o_rank[2]}, {"rank_start_time", &f->o_rank[3]}, {"rank_mapped_bytes", &f->o_rank[4]},
        {"rank_acked_seq", &f->o_rank[5]}, {"rank_flags", &f->o_rank[6]}, {"tp_world", NULL},
        {"blocks_cached", &f->o_cached}, {"evicted_blocks", &f->o_evicted}, {"limit_status", &f->o_limit_status},
        {"closing", &f->o_closing}, {"effective_limit", &f->o_effective}, {"applied_revision", &f->o_applied},
        {"trim_ack_seq", &f->o_trim_ack}, {"trim_bytes", &f->o_trim_bytes}, {"requested_limit", &f->o_requested},
        {"trimmed_total", &f->o_trimmed}, {"idle_returned", &f->o_idle_returned}, {"ranks_active", &f->o_ranks_active},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        PyObject *o = PyDict_GetItemString(offsets, fields[i].key);
        if (!o) {
            PyErr_Format(PyExc_KeyError, "offsets lacks %s", fields[i].key);
            return -1;
        }
        long long x = PyLong_AsLongLong(o);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (fields[i].dst) *fields[i].dst = (Py_ssize_t)x;
        else if (!strcmp(fields[i].key, "cached_shift")) f->cached_shift = (int)x;
        else if (!strcmp(fields[i].key, "page_mapped")) f->page_mapped = (unsigned long)x;
        else if (!strcmp(fields[i].key, "limit_deferred")) f->limit_deferred = (long)x;
        else if (!strcmp(fields[i].key, "tp_world")) tp_world = x;
        else f->bundle_bytes = x;
    }
    if (f->o_rank[1] != f->o_rank[0] + 4 || f->o_rank[2] != f->o_rank[1] + 4 || f->ranks_max > MAX_RANKS) {
        PyErr_SetString(PyExc_ValueError, "the rank record's layout changed (rank and device: two adjacent 32-bit "
                                          "words; at most 64 ranks); update fastpath.c");
        return -1;
    }
    if (tp_world > 1 && !(f->rank_records = role_attr(names, mgr, "rank_records"))) return -1;
    /* limit_status and closing are the counters' two 32-bit words (layout.COUNTERS: "ii"); the rest are 64-bit */
    if (f->o_closing != f->o_limit_status + 4 || f->o_effective != f->o_closing + 4) {
        PyErr_SetString(PyExc_ValueError, "the counters' layout changed: limit_status and closing are no longer "
                                          "two adjacent 32-bit words; update fastpath.c");
        return -1;
    }
    return 0;
}

static int FastPath_traverse(FastPath *f, visitproc visit, void *arg) {
    Py_VISIT(f->mgr);
    Py_VISIT(f->mgr_d);
    Py_VISIT(f->pages_d);
    Py_VISIT(f->seg_d);
    Py_VISIT(f->pages);
    Py_VISIT(f->cache);
    Py_VISIT(f->seg);
    Py_VISIT(f->view);
    Py_VISIT(f->empty_page);
    Py_VISIT(f->release_blocks);
    Py_VISIT(f->pool_overflow);
    Py_VISIT(f->update_limit);
    Py_VISIT(f->publish_all);
    Py_VISIT(f->cache_remove);
    Py_VISIT(f->nonempty);
    Py_VISIT(f->py_alloc);
    Py_VISIT(f->alloc_missed);
    Py_VISIT(f->lock_acquire);
    Py_VISIT(f->lock_release);
    Py_VISIT(f->refill_notify);
    Py_VISIT(f->rank_records);
    return 0;
}

static int FastPath_clear(FastPath *f) {
    Py_CLEAR(f->mgr);
    Py_CLEAR(f->mgr_d);
    Py_CLEAR(f->pages_d);
    Py_CLEAR(f->seg_d);
    Py_CLEAR(f->pages);
    Py_CLEAR(f->cache);
    Py_CLEAR(f->seg);
    Py_CLEAR(f->view);
    Py_CLEAR(f->used);
    Py_CLEAR(f->cap);
    Py_CLEAR(f->slots);
    Py_CLEAR(f->partial);
    Py_CLEAR(f->reserved);
    Py_CLEAR(f->block_used);
    Py_CLEAR(f->touched);
    Py_CLEAR(f->mapped);
    Py_CLEAR(f->empty_page);
    Py_CLEAR(f->release_blocks);
    Py_CLEAR(f->pool_overflow);
    Py_CLEAR(f->update_limit);
    Py_CLEAR(f->publish_all);
    Py_CLEAR(f->cache_remove);
    Py_CLEAR(f->nonempty);
    Py_CLEAR(f->py_alloc);
    Py_CLEAR(f->alloc_missed);
    Py_CLEAR(f->lock_acquire);
    Py_CLEAR(f->lock_release);
    Py_CLEAR(f->refill_notify);
    Py_CLEAR(f->rank_records);
    for (int i = 0; i < N_FIELDS; i++) Py_CLEAR(f->n[i]);
    return 0;
}

static void FastPath_dealloc(FastPath *f) {
    PyObject_GC_UnTrack(f);
    FastPath_clear(f);
    if (f->idcache) {
        for (Py_ssize_t i = 0; i < f->nblocks; i++) Py_XDECREF(f->idcache[i]);
        PyMem_Free(f->idcache);
    }
    if (f->pagecache) {
        for (Py_ssize_t i = 0; i < f->npages; i++) Py_XDECREF(f->pagecache[i]);
        PyMem_Free(f->pagecache);
    }
    PyMem_Free(f->counts);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef FastPath_methods[] = {
    {"free", (PyCFunction)FastPath_free, METH_O, "free(ids) -> True when done, False when Python must do it"},
    {"publish", (PyCFunction)FastPath_publish, METH_NOARGS, "publish() -> None: manager._publish, every counter"},
    {"alloc", (PyCFunction)(void (*)(void))FastPath_alloc, METH_FASTCALL, "alloc(n, near) -> block ids, or None when pages ran out"},
    {"manager_alloc", (PyCFunction)(void (*)(void))FastPath_manager_alloc, METH_FASTCALL | METH_KEYWORDS,
     "manager_alloc($self, n, *, near=None)\n--\n\nKVCacheManager.alloc, lock and all: ``n`` block ids, or None"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcached_core.allocator._fastpath.FastPath",
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One allocator's alloc path in C over its own page table and segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastPath_init,
    .tp_dealloc = (destructor)FastPath_dealloc,
    .tp_traverse = (traverseproc)FastPath_traverse,
    .tp_clear = (inquiry)FastPath_clear,
    .tp_methods = FastPath_methods,
};

#ifdef KVC_PROFILE
static PyObject *stamps(PyObject *self, PyObject *unused) {
    PyObject *t = PyTuple_New(10);
    for (int i = 0; t && i < 10; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(kvc_stamps[i]);
        if (!o) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, o);
    }
    return t;
}

static PyMethodDef module_methods[] = {
    {"stamps", stamps, METH_NOARGS, "the last alloc's stage timestamps (TSC)"},
    {NULL, NULL, 0, NULL},
};
#else
static PyMethodDef module_methods[] = {{NULL, NULL, 0, NULL}};
#endif

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvcached_core.allocator._fastpath", .m_doc = NULL, .m_size = -1, .m_methods = module_methods,
};

/* module.<key> = the role names, a tuple of str: fastpath.BINDING must name an attribute for each. */
static int add_roles(PyObject *m, const char *key, const char *const *roles, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t && i < n; i++) {
        PyObject *o = PyUnicode_FromString(roles[i]);
        if (!o) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, o);
    }
    if (!t) return -1;
    int r = PyModule_AddObjectRef(m, key, t);
    Py_DECREF(t);
    return r;
}

PyMODINIT_FUNC PyInit__fastpath(void) {
    crc_init();
    S_near = PyUnicode_InternFromString("near");
    if (PyType_Ready(&FastPathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "FastPath", (PyObject *)&FastPathType) < 0 ||
        add_roles(m, "FIELD_ROLES", FIELD_ROLE_NAMES, N_FIELDS) < 0 ||
        add_roles(m, "OBJECT_ROLES", OBJECT_ROLE_NAMES, sizeof OBJECT_ROLE_NAMES / sizeof OBJECT_ROLE_NAMES[0]) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef KVC_SOURCE_DIGEST
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", KVC_SOURCE_DIGEST) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
