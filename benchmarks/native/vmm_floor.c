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
 * Build: nvcc -O2 -o vmm_floor vmm_floor.c -lcuda   (or cc -O2 -I$CUDA/include ... -lcuda)
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

static void grow(int from_pool) {
    for (size_t first = 0; first < npages; first += batch) {
        size_t n = npages - first < batch ? npages - first : batch;
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
}

static void shrink(int release) {
    for (size_t first = 0; first < npages; first += batch) {
        size_t n = npages - first < batch ? npages - first : batch;
        for (size_t s = 0; s < slices; s++) CK(cuMemUnmap(addr(first, s), n * slice_bytes));
        for (size_t i = first * slices; i < (first + n) * slices; i++) {
            if (release) CK(cuMemRelease(mapped[i]));
            else pool[pool_len++] = mapped[i];
        }
    }
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

static void report(const char *layout, const char *op, int round, double us) {
    printf("{\"impl\": \"native\", \"layout\": \"%s\", \"op\": \"%s\", \"batch\": %zu, \"round\": %d, "
           "\"us_per_page_id\": %.3f}\n", layout, op, batch, round, us / npages);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s layer|page LAYERS BUFFERS PAGE_MB NPAGES ROUNDS BATCH\n", argv[0]);
        return 2;
    }
    layer_layout = strcmp(argv[1], "layer") == 0;
    size_t layers = atoi(argv[2]), buffers = atoi(argv[3]), page = (size_t)atoi(argv[4]) << 20;
    npages = atoi(argv[5]);
    int rounds = atoi(argv[6]);
    batch = atoi(argv[7]);
    if (!layers || !buffers || !page || !npages || rounds <= 0 || !batch) {
        fprintf(stderr, "all numbers must be positive\n");
        return 2;
    }
    slices = layer_layout ? layers * buffers : 1;
    slice_bytes = layer_layout ? page : page * layers * buffers;
    range_bytes = page * npages;

    CK(cuInit(0));
    CUdevice dev;
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
    size_t total = page * layers * buffers * npages;
    CK(cuMemAddressReserve(&va, total, page, 0, 0));
    mapped = calloc(npages * slices, sizeof *mapped);
    pool = calloc(npages * slices, sizeof *pool);

    grow(0); shrink(1); /* warm-up: first touches of the driver's page tables */
    for (int r = 0; r < rounds; r++) {
        double t0 = now_us(); grow(0);
        double t1 = now_us(); shrink(0);
        double t2 = now_us(); grow(1);
        double t3 = now_us(); shrink(1);
        double t4 = now_us(); grow_naive();
        double t5 = now_us(); shrink_naive();
        double t6 = now_us();
        report(argv[1], "grow_cold", r, t1 - t0);
        report(argv[1], "shrink_keep", r, t2 - t1);
        report(argv[1], "grow_warm", r, t3 - t2);
        report(argv[1], "shrink_release", r, t4 - t3);
        report(argv[1], "grow_naive", r, t5 - t4);
        report(argv[1], "shrink_naive", r, t6 - t5);
    }
    CK(cuMemAddressFree(va, total));
    CK(cuDevicePrimaryCtxRelease(dev));
    free(mapped);
    free(pool);
    return 0;
}
