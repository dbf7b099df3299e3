/* A persistent pool of worker threads for the kernels (pool.c). */
#ifndef SD_POOL_H
#define SD_POOL_H

#include <stdint.h>
#include <stdlib.h>

/* Below SD_SPREAD_FROM values a call's work stays on the calling thread: waking the workers costs more than they
 * save. SD_CHUNK_FROM: the same for the steps around a MoE call's products (rounding x, gathers, sums), where a
 * decode window of 8 rows (8 x 8 x 2,048 values) stays on the calling thread and a prompt chunk spreads. */
#define SD_SPREAD_FROM 65536
#define SD_CHUNK_FROM (1 << 18)

/* fn(ctx, item, thread) for every item in [0, items); thread is 0..threads-1 (per-thread buffers). */
typedef void (*sd_task)(void *ctx, int64_t item, int thread);

/* Runs the items on `threads` threads (the caller's included), handing out `chunk` items at a time
 * as threads free up, and returns when all are done. Calls from one thread at a time. */
void sd_parallel(int threads, int64_t items, int64_t chunk, sd_task fn, void *ctx);

/* Several jobs' items in one sd_parallel: job i owns items first[i] .. first[i + 1] - 1 (first ascending, count
 * jobs). The job that owns `item`: the last i with first[i] <= item. */
static inline int64_t sd_owner(const int64_t *first, int64_t count, int64_t item) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* A buffer of at least `bytes` kept in *mem (*size its bytes: both the caller's, static or per thread), grown
 * (64-byte aligned) when too small and kept for later calls: scratch whose fresh pages would cost every call their
 * page faults. NULL when out of memory. */
static inline void *sd_kept(void **mem, size_t *size, size_t bytes) {
    if (bytes > *size) {
        free(*mem);
        *mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *size = *mem ? bytes : 0;
    }
    return *mem;
}

#endif
