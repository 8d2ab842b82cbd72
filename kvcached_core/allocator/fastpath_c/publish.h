/* The publish, mirrored from manager._publish: the manager's counters read before the seqlock opens,
 * the touched pages' entries, the rank records and the counters written inside it.
 * One part of fastpath.c's single compilation unit (it #includes each once, in order), so every helper
 * stays static and inlinable as in one file. */
#pragma once

#include "common.h"

static inline void put_u64(char *buf, Py_ssize_t off, uint64_t v) { memcpy(buf + off, &v, 8); }
static inline void put_i32(char *buf, Py_ssize_t off, int32_t v) { memcpy(buf + off, &v, 4); }

/* What a full publish (manager._publish) writes besides the page table's figures: the manager's
 * counters, read before the seqlock opens, so that no Python runs inside its window. */
typedef struct {
    long long cached, alloc_count, free_count, alloc_blocks, free_blocks, evicted, limit_status, closing,
        effective, applied, trim_ack, trim_bytes, requested, trimmed, idle_returned;
} Full;

static int read_full(FastPath *f, Full *c) {
    struct { PyObject *name; long long *dst; } ints[] = {
        {f->n[R_alloc_count], &c->alloc_count}, {f->n[R_free_count], &c->free_count}, {f->n[R_alloc_blocks], &c->alloc_blocks},
        {f->n[R_free_blocks], &c->free_blocks}, {f->n[R_evicted_blocks], &c->evicted}, {f->n[R_limit_status], &c->limit_status},
        {f->n[R_applied_revision], &c->applied}, {f->n[R_trim_ack_seq], &c->trim_ack}, {f->n[R_trim_bytes], &c->trim_bytes},
        {f->n[R_requested_limit], &c->requested}, {f->n[R_trimmed_total], &c->trimmed}, {f->n[R_idle_returned], &c->idle_returned},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        long v;
        if (get_long_attr(f->mgr_d, ints[i].name, &v) < 0) return -1;
        *ints[i].dst = v;
    }
    PyObject *blocks = PyObject_GetAttr(f->cache, f->n[R_blocks]); /* len(manager.cache) is len(cache.blocks) */
    if (!blocks) return -1;
    Py_ssize_t cached = PyDict_Check(blocks) ? PyDict_GET_SIZE(blocks) : PyObject_Length(blocks);
    Py_DECREF(blocks);
    if (cached < 0) return -1;
    c->cached = cached;
    PyObject *closed = PyDict_GetItemWithError(f->mgr_d, f->n[R_closed]), *limit;
    if (!closed) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, f->n[R_closed]);
        return -1;
    }
    int truth = PyObject_IsTrue(closed);
    if (truth < 0) return -1;
    c->closing = truth;
    if (!(limit = PyDict_GetItemWithError(f->mgr_d, f->n[R_limit_pages]))) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, f->n[R_limit_pages]);
        return -1;
    }
    if (limit == Py_None) {
        c->effective = -1;
    } else {
        long pages = PyLong_AsLong(limit);
        if (pages == -1 && PyErr_Occurred()) return -1;
        c->effective = pages * f->bundle_bytes;
    }
    return 0;
}

/* Tensor parallelism: each rank's record (layout.RANK_FIELDS), asked of the manager before the seqlock
 * window opens (the window itself runs no Python) and written inside it, as _publish_python does. */
#define RANK_WORDS 7
#define MAX_RANKS 64
typedef struct {
    Py_ssize_t n;
    long long v[MAX_RANKS][RANK_WORDS];
} Ranks;

static int read_ranks(FastPath *f, Ranks *r) {
    r->n = 0;
    if (!f->rank_records) return 0;
    PyObject *got = PyObject_CallNoArgs(f->rank_records);
    if (!got) return -1;
    PyObject *seq = PySequence_Fast(got, "rank_records() must return a sequence of records");
    Py_DECREF(got);
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > f->ranks_max) {
        PyErr_Format(PyExc_ValueError, "%zd rank records for a segment with room for %zd", n, f->ranks_max);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) != RANK_WORDS) {
            PyErr_SetString(PyExc_TypeError, "a rank record is a tuple of layout.RANK_FIELDS");
            goto fail;
        }
        for (int k = 0; k < RANK_WORDS; k++) {
            r->v[i][k] = PyLong_AsLongLong(PyTuple_GET_ITEM(rec, k));
            if (r->v[i][k] == -1 && PyErr_Occurred()) goto fail;
        }
    }
    r->n = n;
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* manager._publish: the touched pages' entries and the counters, under the seqlock. With ``full``
 * (manager._publish itself) every counter; without (an alloc or a free) only those the operation
 * changes, every other counter being as the last full publish left it: the operation's own two
 * (alloc_count/alloc_blocks or free_count/free_blocks) come as offset and value. */
static int publish(FastPath *f, Py_ssize_t off_count, long long count_value, Py_ssize_t off_blocks,
                   long long blocks_value, const Full *full) {
    Py_buffer b;
    PyObject *by_page = NULL, *it = NULL, *item;
    long seq0, page_sum0;
    Ranks ranks;
    if (read_ranks(f, &ranks) < 0) return -1;
    if (get_long_attr(f->seg_d, f->n[R_seq], &seq0) < 0 || get_long_attr(f->seg_d, f->n[R_page_sum], &page_sum0) < 0) return -1;
    by_page = PyObject_GetAttr(f->cache, f->n[R_by_page]);
    if (!by_page) return -1;
    if (PyObject_GetBuffer(f->view, &b, PyBUF_WRITABLE) < 0) {
        Py_DECREF(by_page);
        return -1;
    }
    STAMP(6);
    char *buf = (char *)b.buf;
    long long page_sum = page_sum0;
    uint64_t seq = (uint64_t)seq0 + 1;
    put_u64(buf, f->seq_off, seq);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    if (PySet_GET_SIZE(f->touched)) {
        const char *mapped = PyByteArray_AS_STRING(f->mapped);
        it = PyObject_GetIter(f->touched);
        if (!it) goto fail;
        while ((item = PyIter_Next(it))) {
            long page = PyLong_AsLong(item);
            if (page < 0 || page >= PyList_GET_SIZE(f->used)) {
                Py_DECREF(item);
                if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "page table: touched page %ld out of range", page);
                goto fail;
            }
            PyObject *on_page = PyDict_GetItemWithError(by_page, item); /* borrowed */
            Py_DECREF(item);
            if (PyErr_Occurred()) goto fail;
            uint32_t entry = (mapped[page] ? (uint32_t)f->page_mapped : 0u) | (uint32_t)list_long(f->used, page);
            if (on_page) {
                Py_ssize_t cached = PyObject_Length(on_page);
                if (cached < 0) goto fail;
                entry |= (uint32_t)cached << f->cached_shift;
            }
            uint32_t old;
            memcpy(&old, buf + f->page_map_off + 4 * page, 4);
            if (old != entry) {
                memcpy(buf + f->page_map_off + 4 * page, &entry, 4);
                page_sum += (long long)entry - (long long)old;
            }
        }
        Py_CLEAR(it);
        if (PyErr_Occurred() || PySet_Clear(f->touched) < 0) goto fail;
    }
    STAMP(7);
    for (Py_ssize_t i = 0; i < ranks.n; i++) { /* rank and device are 32-bit, the rest 64-bit (checked at init) */
        char *rec = buf + f->ranks_off + i * f->rank_size;
        memset(rec, 0, (size_t)f->rank_size);
        put_i32(rec, f->o_rank[0], (int32_t)ranks.v[i][0]);
        put_i32(rec, f->o_rank[1], (int32_t)ranks.v[i][1]);
        for (int k = 2; k < RANK_WORDS; k++) put_u64(rec, f->o_rank[k], (uint64_t)ranks.v[i][k]);
    }
    Py_ssize_t reserved = PyList_GET_SIZE(f->reserved);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    put_u64(buf, f->o_inuse, (uint64_t)f->inuse);
    put_u64(buf, f->o_reserved, (uint64_t)reserved);
    put_u64(buf, f->o_blocks_used, (uint64_t)f->blocks_used);
    put_u64(buf, f->o_mapped, (uint64_t)((f->inuse + reserved) * f->bundle_bytes));
    if (full) {
        put_u64(buf, f->o_cached, (uint64_t)full->cached);
        put_u64(buf, f->o_alloc_count, (uint64_t)full->alloc_count);
        put_u64(buf, f->o_free_count, (uint64_t)full->free_count);
        put_u64(buf, f->o_alloc_blocks, (uint64_t)full->alloc_blocks);
        put_u64(buf, f->o_free_blocks, (uint64_t)full->free_blocks);
        put_u64(buf, f->o_evicted, (uint64_t)full->evicted);
        put_i32(buf, f->o_limit_status, (int32_t)full->limit_status);
        put_i32(buf, f->o_closing, (int32_t)full->closing);
        put_u64(buf, f->o_effective, (uint64_t)full->effective);
        put_u64(buf, f->o_applied, (uint64_t)full->applied);
        put_u64(buf, f->o_trim_ack, (uint64_t)full->trim_ack);
        put_u64(buf, f->o_trim_bytes, (uint64_t)full->trim_bytes);
        put_u64(buf, f->o_requested, (uint64_t)full->requested);
        put_u64(buf, f->o_trimmed, (uint64_t)full->trimmed);
        put_u64(buf, f->o_idle_returned, (uint64_t)full->idle_returned);
        put_u64(buf, f->o_ranks_active, (uint64_t)(ranks.n > 1 ? ranks.n : 1));
    } else {
        put_u64(buf, off_count, (uint64_t)count_value);
        put_u64(buf, off_blocks, (uint64_t)blocks_value);
    }
    put_u64(buf, f->o_updated, (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
    put_u64(buf, f->o_page_sum, (uint64_t)page_sum);
    seq += 1;
    STAMP(8);
    uint32_t crc = crc32_of((const unsigned char *)buf + f->counters_off, f->counters_len);
    put_u64(buf, f->checksum_off, (uint64_t)(crc ^ (uint32_t)seq));
    __atomic_thread_fence(__ATOMIC_RELEASE);
    put_u64(buf, f->seq_off, seq);
    PyBuffer_Release(&b);
    Py_DECREF(by_page);
    if (set_long_attr(f->seg_d, f->n[R_seq], (long long)seq) < 0) return -1;
    return set_long_attr(f->seg_d, f->n[R_page_sum], page_sum);
fail:
    Py_XDECREF(it);
    PyBuffer_Release(&b);
    Py_DECREF(by_page);
    return -1;
}
