/* Native floor for kvcached_core's CUDA backend: the same driver calls in the same order, from C.
 *
 * For one layout it grows and shrinks NPAGES page ids, BATCH page ids per step, ROUNDS times:
 *   grow_cold       every handle from cuMemCreate, cuMemMap per handle, then one cuMemSetAccess
 *                   per range over the batch (what CudaBackend.map_pages does)
 *   shrink_keep     one cuMemUnmap per range over the batch, handles kept in a pool
 *   grow_warm       handles from the pool: cuMemMap + cuMemSetAccess only
 *   shrink_release  cuMemUnmap per range over the batch, then cuMemRelease per handle
 *   grow_naive      create + map + set_access per handle, one call each (the textbook sequence)
 *   shrink_naive    unmap + release per handle
 * Layouts: "layer" = LAYERS*BUFFERS handles of PAGE_MB per page id, each in its own range;
 *          "page"  = one handle of LAYERS*BUFFERS*PAGE_MB per page id in one range.
 * Prints one JSON object per op and round: microseconds per page id.
 *
 * benchmarks/vmm.py loads it as a shared library and calls floor_setup / floor_chunk /
 * floor_teardown from the same process as the Python backend, taking turns chunk by chunk, so
 * both share one context and one driver state and the machine's drift cancels (separate
 * processes, or whole rounds in turn, drifted by 15-25 % on the same machine).
 *
 * Build: nvcc -O2 -o vmm_floor vmm_floor.c -lcuda   (or cc -O2 -I$CUDA/include ... -lcuda)
 *        nvcc -O2 -Xcompiler -fPIC -shared -o libvmm_floor.so vmm_floor.c -lcuda
 * Run:   ./vmm_floor layer 32 2 2 64 5 1
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(call)                                                                  \
    do {                                                                          \
        CUresult r_ = (call);                                                     \
        if (r_ != CUDA_SUCCESS) {                                                 \
            const char *n_ = NULL;                                                \
            cuGetErrorName(r_, &n_);                                              \
            fprintf(stderr, "%s failed: %s (line %d)\n", #call, n_ ? n_ : "?", __LINE__); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int layer_layout;
static size_t slices, slice_bytes, range_bytes, npages, batch;
static CUdeviceptr va;
static CUmemAllocationProp prop;
static CUmemAccessDesc acc;
static CUmemGenericAllocationHandle *mapped; /* [npages * slices] */
static CUmemGenericAllocationHandle *pool;
static size_t pool_len;

static CUdeviceptr addr(size_t page, size_t s) {
    return layer_layout ? va + s * range_bytes + page * slice_bytes : va + page * slice_bytes;
}

/* Page ids [first, first + n): the calls CudaBackend makes for one map_pages / unmap_pages. */
static void grow_range(size_t first, size_t n, int from_pool) {
    for (size_t p = first; p < first + n; p++) {
        CUmemGenericAllocationHandle *h = &mapped[p * slices];
        for (size_t s = 0; s < slices; s++) {
            if (from_pool && pool_len) h[s] = pool[--pool_len];
            else CK(cuMemCreate(&h[s], slice_bytes, &prop, 0));
        }
        for (size_t s = 0; s < slices; s++) CK(cuMemMap(addr(p, s), slice_bytes, 0, h[s], 0));
    }
    for (size_t s = 0; s < slices; s++) CK(cuMemSetAccess(addr(first, s), n * slice_bytes, &acc, 1));
}

static void shrink_range(size_t first, size_t n, int release) {
    for (size_t s = 0; s < slices; s++) CK(cuMemUnmap(addr(first, s), n * slice_bytes));
    for (size_t i = first * slices; i < (first + n) * slices; i++) {
        if (release) CK(cuMemRelease(mapped[i]));
        else pool[pool_len++] = mapped[i];
    }
}

static void grow(int from_pool) {
    for (size_t first = 0; first < npages; first += batch)
        grow_range(first, npages - first < batch ? npages - first : batch, from_pool);
}

static void shrink(int release) {
    for (size_t first = 0; first < npages; first += batch)
        shrink_range(first, npages - first < batch ? npages - first : batch, release);
}

static void grow_naive(void) {
    for (size_t p = 0; p < npages; p++)
        for (size_t s = 0; s < slices; s++) {
            CUmemGenericAllocationHandle *h = &mapped[p * slices + s];
            CK(cuMemCreate(h, slice_bytes, &prop, 0));
            CK(cuMemMap(addr(p, s), slice_bytes, 0, *h, 0));
            CK(cuMemSetAccess(addr(p, s), slice_bytes, &acc, 1));
        }
}

static void shrink_naive(void) {
    for (size_t p = 0; p < npages; p++)
        for (size_t s = 0; s < slices; s++) {
            CK(cuMemUnmap(addr(p, s), slice_bytes));
            CK(cuMemRelease(mapped[p * slices + s]));
        }
}

static size_t total_bytes;
static CUdevice dev;

/* Set up one layout; 0 on success. The primary context is shared with whoever else uses device 0. */
int floor_setup(int layer, size_t layers, size_t buffers, size_t page_mb, size_t pages, size_t batch_ids) {
    size_t page = page_mb << 20;
    layer_layout = layer;
    npages = pages;
    batch = batch_ids;
    slices = layer_layout ? layers * buffers : 1;
    slice_bytes = layer_layout ? page : page * layers * buffers;
    range_bytes = page * npages;
    total_bytes = page * layers * buffers * npages;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    /* The driver takes only a power-of-two alignment (a 28 MiB one is CUDA_ERROR_INVALID_VALUE): the largest
     * power of two dividing the page, as kvcached_core.backends.cuda.reserve_alignment (page is whole MiB). */
    CK(cuMemAddressReserve(&va, total_bytes, page & (~page + 1), 0, 0));
    mapped = calloc(npages * slices, sizeof *mapped);
    pool = calloc(npages * slices, sizeof *pool);
    pool_len = 0;
    return mapped && pool ? 0 : 1;
}

/* One op over all page ids; microseconds per page id. Ops must run in the order
 * grow_cold(0) shrink_keep(1) grow_warm(2) shrink_release(3), then grow_naive(4) shrink_naive(5). */
double floor_op(int op) {
    double t0 = now_us();
    switch (op) {
        case 0: grow(0); break;
        case 1: shrink(0); break;
        case 2: grow(1); break;
        case 3: shrink(1); break;
        case 4: grow_naive(); break;
        case 5: shrink_naive(); break;
        default: return -1;
    }
    return (now_us() - t0) / npages;
}

/* One chunk of page ids for op 0-3 (as floor_op), timed here: microseconds for the whole chunk. */
double floor_chunk(int op, size_t first, size_t n) {
    double t0 = now_us();
    switch (op) {
        case 0: grow_range(first, n, 0); break;
        case 1: shrink_range(first, n, 0); break;
        case 2: grow_range(first, n, 1); break;
        case 3: shrink_range(first, n, 1); break;
        default: return -1;
    }
    return now_us() - t0;
}

void floor_teardown(void) {
    CK(cuMemAddressFree(va, total_bytes));
    CK(cuDevicePrimaryCtxRelease(dev));
    free(mapped);
    free(pool);
    mapped = pool = NULL;
}

static void report(const char *layout, const char *op, int round, double us) {
    printf("{\"impl\": \"native\", \"layout\": \"%s\", \"op\": \"%s\", \"batch\": %zu, \"round\": %d, "
           "\"us_per_page_id\": %.3f}\n", layout, op, batch, round, us);
    fflush(stdout);
}

int main(int argc, char **argv) {
    static const char *names[] = {"grow_cold", "shrink_keep", "grow_warm", "shrink_release", "grow_naive",
                                  "shrink_naive"};
    if (argc != 8) {
        fprintf(stderr, "usage: %s layer|page LAYERS BUFFERS PAGE_MB NPAGES ROUNDS BATCH\n", argv[0]);
        return 2;
    }
    int rounds = atoi(argv[6]);
    if (atoi(argv[2]) <= 0 || atoi(argv[3]) <= 0 || atoi(argv[4]) <= 0 || atoi(argv[5]) <= 0 || rounds <= 0 ||
        atoi(argv[7]) <= 0) {
        fprintf(stderr, "all numbers must be positive\n");
        return 2;
    }
    if (floor_setup(strcmp(argv[1], "layer") == 0, atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]),
                    atoi(argv[7])))
        return 1;
    floor_op(0);
    floor_op(3); /* warm-up: first touches of the driver's page tables */
    for (int r = 0; r < rounds; r++)
        for (int op = 0; op < 6; op++) report(argv[1], names[op], r, floor_op(op));
    floor_teardown();
    return 0;
}
