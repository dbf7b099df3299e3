/* A persistent pool of worker threads for the kernels (pool.c). */
#ifndef SD_POOL_H
#define SD_POOL_H

#include <stdint.h>

/* fn(ctx, item, thread) for every item in [0, items); thread is 0..threads-1 (per-thread buffers). */
typedef void (*sd_task)(void *ctx, int64_t item, int thread);

/* Runs the items on `threads` threads (the caller's included), handing out `chunk` items at a time
 * as threads free up, and returns when all are done. Calls from one thread at a time. */
void sd_parallel(int threads, int64_t items, int64_t chunk, sd_task fn, void *ctx);

#endif
