/* The allocator's hot path in C: alloc (placement plus the segment publish that follows it) and free.
 *
 * It mirrors kvcached_core/allocator/placement.py (Policy.place, Affinity.place, FirstFit.place,
 * place_draining), pages.py (take_blocks, best_fit, emptiest, lowest_open, free_blocks) and manager.py
 * (free, _release_blocks, _publish) step for step, on the very same Python objects (the page table's
 * lists and sets, the segment's mapping): there is one state, the Python code is the reference and
 * the path without a compiler, and either path may run at any time. tests/test_fastpath.py checks
 * that both produce the same blocks and the same segment bytes. Which attributes it works on is
 * fastpath.py's BINDING, passed in as ``names`` (FIELD_ROLES and OBJECT_ROLES below list the roles it
 * needs); where the segment keeps what it writes, fastpath._offsets. The interpreter's dispatch is
 * what this removes (benchmarks/probes/tight_alloc.py compares the two paths).
 *
 * Built when the package is installed (setup.py), as the optional extension kvcached_core.allocator._fastpath;
 * without it the allocator stays on the Python path and says so once.
 */
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

static PyObject *id_object(FastPath *f, long block) {
    if (block < 0 || block >= (long)f->nblocks) return PyLong_FromLong(block);
    PyObject *o = f->idcache[block];
    if (!o) {
        o = PyLong_FromLong(block);
        if (!o) return NULL;
        f->idcache[block] = o;
    }
    return Py_NewRef(o);
}

static PyObject *page_object(FastPath *f, long page) {
    if (page < 0 || page >= f->npages) return PyLong_FromLong(page);
    PyObject *o = f->pagecache[page];
    if (!o) {
        o = PyLong_FromLong(page);
        if (!o) return NULL;
        f->pagecache[page] = o;
    }
    return Py_NewRef(o);
}

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
