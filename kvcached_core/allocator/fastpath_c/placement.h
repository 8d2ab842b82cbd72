/* Placement, mirrored from placement.py: best-fit, affinity, first-fit and a waiting limit's
 * fullest-first placement.
 * One part of fastpath.c's single compilation unit (it #includes each once, in order), so every helper
 * stays static and inlinable as in one file. */
#pragma once

#include "pages.h"

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define TAKE(page, k) do { if (take_blocks(f, (page), (k), taken) < 0) return -1; remaining -= (k); } while (0)

/* Policy.place (best-fit); 1 placed, 0 pages ran out, -1 error */
static int place_best_fit(FastPath *f, long remaining, Ids *taken) {
    long page, bpp = (long)f->bpp;
    while (remaining >= bpp) {
        page = empty_page(f);
        if (page == -1) return -1;
        if (page == -2) break;
        long k = MIN(list_long(f->cap, page), remaining);
        TAKE(page, k);
    }
    if (!remaining) return 1;
    page = best_fit(f, remaining);
    if (page == -2) page = empty_page(f);
    if (page == -2) page = emptiest(f);
    while (page >= 0) {
        long k = MIN(free_slots(f, page), remaining);
        TAKE(page, k);
        if (!remaining) return 1;
        page = emptiest(f);
        if (page == -2) page = empty_page(f);
    }
    return page == -1 ? -1 : 0;
}

/* Affinity.place */
static int place_affinity(FastPath *f, long n, long near, Ids *taken) {
    long remaining = n;
    if (near >= 0 && near < (long)f->nblocks) {
        long page = near / (long)f->bpp;
        long used = list_long(f->used, page);
        if (used && used < list_long(f->cap, page)) {
            long k = MIN(free_slots(f, page), remaining);
            TAKE(page, k);
            if (!remaining) return 1;
        }
        long open_slots = f->inuse * (long)f->bpp - f->blocks_used;
        if (remaining == 1 && (double)(open_slots + (long)f->bpp) <= f->slack * (double)f->blocks_used) {
            page = empty_page(f);
            if (page == -1) return -1;
            if (page >= 0) {
                TAKE(page, 1);
                return 1;
            }
        }
    }
    return place_best_fit(f, remaining, taken);
}

/* PageTable.lowest_open: the lowest-numbered mapped page with a free slot, in use or pooled; -2 none */
static long lowest_open(FastPath *f) {
    long best = LONG_MAX;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(f->reserved); i++) {
        long page = list_long(f->reserved, i);
        if (page == -1 && PyErr_Occurred()) return -1;
        if (page < best) best = page;
    }
    for (long fr = 1; fr <= (long)f->bpp; fr++) {
        PyObject *bucket = PyList_GET_ITEM(f->partial, fr);
        if (!PySet_GET_SIZE(bucket)) continue;
        long low = set_min(f, bucket);
        if (low < 0) return -1;
        if (low < best) best = low;
    }
    if (best == LONG_MAX) return -2;
    if (best < 0 || best >= PyList_GET_SIZE(f->used)) {
        PyErr_Format(PyExc_RuntimeError, "page table: pool page %ld out of range", best);
        return -1;
    }
    return best;
}

/* PageTable.take_reserved(page): that page leaves the pool (its first occurrence, as list.remove) */
static int take_reserved(FastPath *f, long page) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(f->reserved); i++) {
        if (list_long(f->reserved, i) == page) return PyList_SetSlice(f->reserved, i, i + 1, NULL);
    }
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "page table: page %ld is not in the pool", page);
    return -1;
}

/* FirstFit.place: block after block into the lowest-numbered page with a free slot */
static int place_first_fit(FastPath *f, long remaining, Ids *taken) {
    while (remaining) {
        long page = lowest_open(f);
        if (page == -1) return -1;
        if (page >= 0 && list_long(f->used, page) == 0) {
            if (take_reserved(f, page) < 0) return -1;
        } else if (page == -2) {
            page = empty_page(f);
            if (page < 0) return page == -1 ? -1 : 0;
        }
        long k = MIN(free_slots(f, page), remaining);
        TAKE(page, k);
    }
    return 1;
}

/* placement.place_draining: while a lowered limit waits, the fullest in-use pages first, never a new one */
static int place_draining(FastPath *f, long remaining, Ids *taken) {
    while (remaining) {
        long page = best_fit(f, 1);
        if (page < 0) return page == -1 ? -1 : 0;
        long k = MIN(free_slots(f, page), remaining);
        TAKE(page, k);
    }
    return 1;
}

