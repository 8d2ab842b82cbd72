/* The page table, mirrored from pages.py: its integers loaded and stored around a call, the free-count
 * buckets, best fit, the emptiest and the empty page, taking blocks.
 * One part of fastpath.c's single compilation unit (it #includes each once, in order), so every helper
 * stays static and inlinable as in one file. */
#pragma once

#include "common.h"

/* -- the page table's integers: loaded at the start of a call, stored before any Python callback -- */
static int load_state(FastPath *f) {
    if (get_long_attr(f->pages_d, f->n[R_pages_inuse], &f->inuse) < 0) return -1;
    if (get_long_attr(f->pages_d, f->n[R_blocks_used], &f->blocks_used) < 0) return -1;
    PyObject *nonempty = PyDict_GetItemWithError(f->pages_d, f->n[R_nonempty]);
    if (!nonempty) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, f->n[R_nonempty]);
        return -1;
    }
    Py_XSETREF(f->nonempty, Py_NewRef(nonempty));
    f->bits_c = 0;
    if (f->bpp <= 64) { /* in-use pages have 1..bpp-1 free slots: bits 1..63 */
        f->bits = f->bits_loaded = PyLong_AsUnsignedLongLongMask(nonempty);
        if (f->bits == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        f->bits_c = 1;
    }
    return 0;
}

static int store_state(FastPath *f) {
    if (set_long_attr(f->pages_d, f->n[R_pages_inuse], f->inuse) < 0) return -1;
    if (set_long_attr(f->pages_d, f->n[R_blocks_used], f->blocks_used) < 0) return -1;
    if (f->bits_c && f->bits != f->bits_loaded) {
        PyObject *o = PyLong_FromUnsignedLongLong(f->bits);
        if (!o) return -1;
        Py_SETREF(f->nonempty, o);
        f->bits_loaded = f->bits;
    }
    return PyDict_SetItem(f->pages_d, f->n[R_nonempty], f->nonempty);
}

/* nonempty |= 1 << bit (set) or nonempty &= ~(1 << bit) (clear), as PageTable._list / _unlist */
static int flip_bit(FastPath *f, long bit, int set) {
    if (f->bits_c) {
        if (bit < 0 || bit > 63) {
            PyErr_Format(PyExc_RuntimeError, "page table: bucket %ld out of range", bit);
            return -1;
        }
        f->bits = set ? f->bits | (1ull << bit) : f->bits & ~(1ull << bit);
        return 0;
    }
    PyObject *one = PyLong_FromLong(1), *shift = PyLong_FromLong(bit), *mask = NULL, *res = NULL;
    if (one && shift) mask = PyNumber_Lshift(one, shift);
    if (mask) {
        if (set) {
            res = PyNumber_Or(f->nonempty, mask);
        } else {
            PyObject *inv = PyNumber_Invert(mask);
            if (inv) res = PyNumber_And(f->nonempty, inv);
            Py_XDECREF(inv);
        }
    }
    Py_XDECREF(one);
    Py_XDECREF(shift);
    Py_XDECREF(mask);
    if (!res) return -1;
    Py_SETREF(f->nonempty, res);
    return 0;
}

static int bad_bucket(FastPath *f, long free) {
    if (free >= 0 && free <= (long)f->bpp) return 0;
    PyErr_Format(PyExc_RuntimeError, "page table: %ld free slots on a page of %zd", free, f->bpp);
    return 1;
}

static int unlist(FastPath *f, PyObject *page, long free) {
    if (bad_bucket(f, free)) return -1;
    PyObject *bucket = PyList_GET_ITEM(f->partial, free);
    if (PySet_Discard(bucket, page) < 0) return -1;
    if (PySet_GET_SIZE(bucket) == 0) return flip_bit(f, free, 0);
    return 0;
}

static int enlist(FastPath *f, PyObject *page, long free) {
    if (bad_bucket(f, free)) return -1;
    PyObject *bucket = PyList_GET_ITEM(f->partial, free);
    if (PySet_Add(bucket, page) < 0) return -1;
    return flip_bit(f, free, 1);
}

/* min(bucket) for a set of page ids (each checked to be a page); -1 with an exception on error */
static long set_min(FastPath *f, PyObject *bucket) {
    PyObject *it = PyObject_GetIter(bucket), *item;
    long best = LONG_MAX;
    if (!it) return -1;
    while ((item = PyIter_Next(it))) {
        long v = PyLong_AsLong(item);
        Py_DECREF(item);
        if (v < best) best = v;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return -1;
    if (best < 0 || best >= PyList_GET_SIZE(f->used)) {
        PyErr_Format(PyExc_RuntimeError, "page table: bucket page %ld out of range", best);
        return -1;
    }
    return best;
}

/* The lowest page id in bucket `free`, checked: a page table that disagrees with itself raises
 * instead of sending C past its lists. */
static long bucket_min(FastPath *f, long free) {
    PyObject *bucket;
    if (free < 1 || free > (long)f->bpp || PySet_GET_SIZE(bucket = PyList_GET_ITEM(f->partial, free)) == 0) {
        PyErr_Format(PyExc_RuntimeError, "page table: nonempty marks bucket %ld, which is empty or out of range", free);
        return -1;
    }
    return set_min(f, bucket);
}

/* The page table's `nonempty` bits (bit f: some in-use page has f free slots) as a machine word,
 * when blocks_per_page <= 64: then best_fit and emptiest find their bucket without touching the
 * bucket objects (right after an engine's GPU wait, every object touched is a likely cache miss). */
static int nonempty_bits(FastPath *f, unsigned long long *bits) {
    if (!f->bits_c) return 0;
    *bits = f->bits;
    return 1;
}

/* PageTable.best_fit: the fullest in-use page with room for count (lowest id among equals); -2 none */
static long best_fit(FastPath *f, long count) {
    unsigned long long bits;
    if (count > f->bpp) return -2;
    if (nonempty_bits(f, &bits)) {
        if (count >= 64) return -2; /* no in-use page has 64 free slots (and a 64-bit shift is undefined) */
        bits >>= count;
        return bits ? bucket_min(f, count + __builtin_ctzll(bits)) : -2;
    }
    if (PyErr_Occurred()) return -1;
    for (long fr = count; fr <= f->bpp; fr++) {
        PyObject *bucket = PyList_GET_ITEM(f->partial, fr);
        if (PySet_GET_SIZE(bucket)) return set_min(f, bucket);
    }
    return -2;
}

/* PageTable.emptiest; -2 none */
static long emptiest(FastPath *f) {
    unsigned long long bits;
    if (nonempty_bits(f, &bits)) return bits ? bucket_min(f, 63 - __builtin_clzll(bits)) : -2;
    if (PyErr_Occurred()) return -1;
    for (long fr = f->bpp; fr >= 1; fr--) {
        PyObject *bucket = PyList_GET_ITEM(f->partial, fr);
        if (PySet_GET_SIZE(bucket)) return set_min(f, bucket);
    }
    return -2;
}

/* The manager's _empty_page: the newest pool page, else whatever the manager does (it may map one
 * synchronously). -2 none, -1 error. */
static long empty_page(FastPath *f) {
    Py_ssize_t n = PyList_GET_SIZE(f->reserved);
    if (n) {
        long page = list_long(f->reserved, n - 1);
        if (page < 0 || page >= PyList_GET_SIZE(f->used)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "page table: pool page %ld out of range", page);
            return -1;
        }
        if (PyList_SetSlice(f->reserved, n - 1, n, NULL) < 0) return -1;
        return page;
    }
    if (store_state(f) < 0) return -1;
    PyObject *res = PyObject_CallNoArgs(f->empty_page);
    if (!res) return -1;
    long page = res == Py_None ? -2 : PyLong_AsLong(res);
    Py_DECREF(res);
    if (page == -1 && PyErr_Occurred()) return -1;
    if (page != -2 && (page < 0 || page >= PyList_GET_SIZE(f->used))) {
        PyErr_Format(PyExc_RuntimeError, "page table: pool page %ld out of range", page);
        return -1;
    }
    return load_state(f) < 0 ? -1 : page;
}

/* PageTable.take_blocks: count free slots of page go to taken; returns count or -1 */
static long take_blocks(FastPath *f, long page, long count, Ids *taken) {
    if (page < 0 || page >= PyList_GET_SIZE(f->used)) {
        PyErr_Format(PyExc_RuntimeError, "page table: page %ld out of range", page);
        return -1;
    }
    long before = list_long(f->used, page), cap = list_long(f->cap, page);
    PyObject *pobj = page_object(f, page);
    if (!pobj) return -1;
    if (before == 0) {
        f->inuse++;
    } else if (unlist(f, pobj, cap - before) < 0) {
        goto fail;
    }
    PyObject *slots = PyList_GET_ITEM(f->slots, page);
    if (!PyList_Check(slots) || PyList_GET_SIZE(slots) < count) {
        PyErr_Format(PyExc_RuntimeError, "page %ld has fewer free slots than its count says", page);
        goto fail;
    }
    Py_ssize_t len = PyList_GET_SIZE(slots);
    char *flags = PyByteArray_AS_STRING(f->block_used);
    long base = page * (long)f->bpp;
    for (long i = 0; i < count; i++) {
        long block = base + PyLong_AsLong(PyList_GET_ITEM(slots, len - 1 - i));
        if (ids_push(taken, block) < 0) goto fail;
        flags[block] = 1;
    }
    if (PyList_SetSlice(slots, len - count, len, NULL) < 0) goto fail;
    if (PySet_Add(f->touched, pobj) < 0) goto fail;
    if (list_set_long(f->used, page, before + count) < 0) goto fail;
    f->blocks_used += count;
    if (cap > before + count && enlist(f, pobj, cap - before - count) < 0) goto fail;
    Py_DECREF(pobj);
    return count;
fail:
    Py_DECREF(pobj);
    return -1;
}

static long free_slots(FastPath *f, long page) { return list_long(f->cap, page) - list_long(f->used, page); }

