/* fastpath.c's common ground: the FastPath object, the roles it binds, id lists, the CRC, list
 * and attribute helpers.
 * One part of fastpath.c's single compilation unit (it #includes each once, in order), so every helper
 * stays static and inlinable as in one file. */
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Stage timestamps for benchmarks/probes/alloc_stages.py, compiled in only with -DKVC_PROFILE. */
#ifdef KVC_PROFILE
static unsigned long long kvc_stamps[10];
#if defined(__x86_64__) || defined(__i386__)
#define STAMP(i) (kvc_stamps[i] = __builtin_ia32_rdtsc())
#else
static unsigned long long kvc_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}
#define STAMP(i) (kvc_stamps[i] = kvc_now())
#endif
#else
#define STAMP(i) ((void)0)
#endif

/* The attributes C reads and writes through an owner's __dict__, by role. Which attribute of which
 * object plays each role is fastpath.py's BINDING, handed to FastPath() as ``names``: this file names
 * no Python attribute itself. */
#define FIELD_ROLES(X) \
    X(nonempty) \
    X(pages_inuse) \
    X(blocks_used) \
    X(alloc_count) \
    X(alloc_blocks) \
    X(seq) \
    X(page_sum) \
    X(by_page) \
    X(free_count) \
    X(free_blocks) \
    X(blocks) \
    X(limit_pages) \
    X(limit_status) \
    X(max_reserved) \
    X(inflight) \
    X(closed) \
    X(map_error) \
    X(min_reserved) \
    X(refill_requested) \
    X(refill_polling) \
    X(evicted_blocks) \
    X(applied_revision) \
    X(trim_ack_seq) \
    X(trim_bytes) \
    X(requested_limit) \
    X(trimmed_total) \
    X(idle_returned)
#define ROLE_ENUM(r) R_##r,
#define ROLE_NAME(r) #r,
enum { FIELD_ROLES(ROLE_ENUM) N_FIELDS };
static const char *const FIELD_ROLE_NAMES[N_FIELDS] = {FIELD_ROLES(ROLE_NAME)};
/* The objects FastPath() fetches once by role (role_attr): containers worked in place, methods called. */
#define OBJECT_ROLES(X) \
    X(pages) X(cache) X(segment) X(buf) X(used) X(cap) X(slots) X(partial) X(reserved) X(block_used) \
    X(touched) X(mapped) X(bpp) X(remove) X(empty_page) X(release_blocks) X(pool_overflow) \
    X(update_limit_status) X(publish) X(alloc_missed) X(lock) X(refill_wanted) X(rank_records)
static const char *const OBJECT_ROLE_NAMES[] = {OBJECT_ROLES(ROLE_NAME)};

static PyObject *S_near; /* alloc()'s keyword argument */

/* The placement policies, as fastpath.POLICY_* numbers them */
enum { POLICY_BEST_FIT = 0, POLICY_AFFINITY = 1, POLICY_FIRST_FIT = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *mgr, *pages, *cache, *seg, *view;       /* owners */
    PyObject *mgr_d, *pages_d, *seg_d;                 /* their __dict__s */
    PyObject *n[N_FIELDS];                             /* the attribute names of FIELD_ROLES, from BINDING */
    PyObject *used, *cap, *slots, *partial, *reserved, *block_used, *touched, *mapped;
    PyObject *empty_page, *release_blocks;             /* bound methods of the manager */
    PyObject *pool_overflow, *update_limit, *publish_all, *cache_remove;
    PyObject *py_alloc, *alloc_missed, *lock_acquire, *lock_release, *refill_notify; /* for manager_alloc */
    PyObject *rank_records; /* tensor parallelism: the manager's rank_records method; NULL on one rank */
    Py_ssize_t ranks_off, rank_size, ranks_max, o_rank[7]; /* layout.RANK: where each record and field lies */
    Py_ssize_t bpp, nblocks;
    int policy; /* POLICY_BEST_FIT, POLICY_AFFINITY or POLICY_FIRST_FIT (fastpath.POLICY_*) */
    double slack;
    long long bundle_bytes;
    unsigned long page_mapped;
    int cached_shift;
    long limit_deferred; /* layout.LIMIT_DEFERRED */
    Py_ssize_t seq_off, counters_off, counters_len, checksum_off, page_map_off;
    Py_ssize_t o_inuse, o_reserved, o_blocks_used, o_mapped, o_alloc_count, o_alloc_blocks, o_updated, o_page_sum;
    Py_ssize_t o_free_count, o_free_blocks;
    /* the counters only a full publish (manager._publish) writes */
    Py_ssize_t o_cached, o_evicted, o_limit_status, o_closing, o_effective, o_applied, o_trim_ack, o_trim_bytes,
        o_requested, o_trimmed, o_idle_returned, o_ranks_active;
    /* page-table integers, cached in C for the length of one call */
    long inuse, blocks_used;
    PyObject *nonempty;
    /* nonempty as a machine word while blocks_per_page <= 64 (bits_c): placement flips bits here
     * and store_state makes one int of them, instead of four int objects per flip */
    unsigned long long bits, bits_loaded;
    int bits_c;
    /* One int object per block id, made on first use and handed out again after: an alloc then
     * creates no objects but its list, so it rarely touches fresh heap (a page fault on a VM). */
    PyObject **idcache;
    PyObject **pagecache; /* likewise one int per page id (ids past 256 are not shared by Python) */
    Py_ssize_t npages;    /* pagecache's length */
    long *counts; /* free: blocks freed per page, zero between calls */
} FastPath;

/* The block ids one alloc takes, before they become a list. */
typedef struct {
    long *v;
    Py_ssize_t n, cap;
    long stack[128];
} Ids;

static int ids_push(Ids *ids, long block) {
    if (ids->n == ids->cap) {
        Py_ssize_t cap = 2 * ids->cap;
        long *v = ids->v == ids->stack ? PyMem_Malloc(cap * sizeof(long)) : PyMem_Realloc(ids->v, cap * sizeof(long));
        if (!v) {
            PyErr_NoMemory();
            return -1;
        }
        if (ids->v == ids->stack) memcpy(v, ids->stack, sizeof ids->stack);
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = block;
    return 0;
}

static void ids_free(Ids *ids) {
    if (ids->v != ids->stack) PyMem_Free(ids->v);
}

/* The int object for ``v`` from ``cache`` (``size`` slots, filled on first use), so every alloc hands out the
 * same objects the Python path would; a value outside it is a fresh int. */
static PyObject *cached_int(PyObject **cache, Py_ssize_t size, long v) {
    if (v < 0 || v >= size) return PyLong_FromLong(v);
    if (!cache[v] && !(cache[v] = PyLong_FromLong(v))) return NULL;
    return Py_NewRef(cache[v]);
}

static PyObject *id_object(FastPath *f, long block) { return cached_int(f->idcache, f->nblocks, block); }

static PyObject *page_object(FastPath *f, long page) { return cached_int(f->pagecache, f->npages, page); }

static PyObject *ids_list(FastPath *f, const Ids *ids) {
    PyObject *list = PyList_New(ids->n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < ids->n; i++) {
        PyObject *o = id_object(f, ids->v[i]);
        if (!o) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, o);
    }
    return list;
}

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = crc_table[0][crc_table[t - 1][i] & 0xFF] ^ (crc_table[t - 1][i] >> 8);
}

/* zlib.crc32 (CRC-32/ISO-HDLC), eight bytes a step (little-endian hosts; others go byte by byte) */
static uint32_t crc32_of(const unsigned char *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
    }
#endif
    for (; n > 0; p++, n--) c = crc_table[0][(c ^ *p) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static long list_long(PyObject *list, Py_ssize_t i) { return PyLong_AsLong(PyList_GET_ITEM(list, i)); }

static int list_set_long(PyObject *list, Py_ssize_t i, long v) {
    PyObject *o = PyLong_FromLong(v);
    if (!o) return -1;
    return PyList_SetItem(list, i, o); /* steals o */
}

/* Plain instance attributes, read and written through the instance's __dict__ (held for the
 * object's life): the counters live there, and skipping the attribute protocol halves their cost. */
static int get_long_attr(PyObject *dict, PyObject *name, long *out) {
    PyObject *o = PyDict_GetItemWithError(dict, name); /* borrowed */
    if (!o) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
        return -1;
    }
    *out = PyLong_AsLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_long_attr(PyObject *dict, PyObject *name, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (!o) return -1;
    int r = PyDict_SetItem(dict, name, o);
    Py_DECREF(o);
    return r;
}

