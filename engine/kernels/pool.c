/* The kernels' worker threads.
 *
 * Why not OpenMP: a decode step makes ~130 kernel calls with a few microseconds to a few hundred
 * of Python between them. Sleeping OpenMP threads (OMP_WAIT_POLICY=PASSIVE, what a shared machine
 * needs) pay a wake-up on every call; spinning ones (the default) burn a core whenever the engine
 * idles, and stall the step when another program takes that core. These workers spin for SPIN_US
 * after each job, long enough to cover the gaps inside a step, then sleep until the next one. */
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define SPIN_US 100
#define MAX_WORKERS 255
/* When the workers keep the caller waiting longer than the job took it (another program holds
 * their cores), the next calls run on the caller alone before the workers are tried again: ALONE_FIRST
 * of them, twice as many each time the workers are late again, up to ALONE_MOST. A late call with
 * nothing else running (a worker descheduled for a moment) so costs a few calls alone, not hundreds:
 * measured on a 2-core VM, a fixed 256 ran a third of a decode step's calls alone and cost 12-30% of
 * its speed. */
#define ALONE_FIRST 8
#define ALONE_MOST 256

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
    sd_task fn;
    void *ctx;
    int64_t items, chunk;
    int threads;
} job;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;          /* started, numbered 1..workers (the caller is thread 0) */
    atomic_uint gen;      /* bumped to start a job */
    atomic_int sleepers;  /* workers asleep on `wake` */
    atomic_int pending;   /* workers not yet done with the current job */
    atomic_llong next;    /* the next item to hand out */
    job current;          /* written only while no worker reads it (pending == 0) */
    unsigned born[MAX_WORKERS + 1]; /* gen when each worker was started */
    int alone;                      /* calls left to run on the caller alone */
    int alone_next;                 /* how many the workers' next lateness costs */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .alone_next = ALONE_FIRST};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void run_items(int thread) {
    const job *j = &P.current;
    if (thread >= j->threads) return;
    for (;;) {
        int64_t lo = atomic_fetch_add(&P.next, j->chunk);
        if (lo >= j->items) return;
        int64_t hi = lo + j->chunk < j->items ? lo + j->chunk : j->items;
        for (int64_t i = lo; i < hi; i++) j->fn(j->ctx, i, thread);
    }
}

static unsigned wait_for_job(unsigned seen) {
    double until = now_us() + SPIN_US;
    unsigned g;
    for (int spins = 1; (g = atomic_load(&P.gen)) == seen; spins++) {
        cpu_relax();
        if (spins % 256 == 0 && now_us() > until) {
            pthread_mutex_lock(&P.lock);
            atomic_fetch_add(&P.sleepers, 1);
            while ((g = atomic_load(&P.gen)) == seen) pthread_cond_wait(&P.wake, &P.lock);
            atomic_fetch_sub(&P.sleepers, 1);
            pthread_mutex_unlock(&P.lock);
            break;
        }
    }
    return g;
}

static void *worker(void *arg) {
    int thread = (int)(intptr_t)arg;
    unsigned seen = P.born[thread]; /* not gen now: the first job may have started already */
    for (;;) {
        seen = wait_for_job(seen);
        run_items(thread);
        atomic_fetch_sub(&P.pending, 1);
    }
    return NULL;
}

/* A forked child has none of the parent's workers. */
static void forget_workers(void) { P.workers = 0; }

static int start_workers(int want) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers);
        registered = 1;
    }
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    while (P.workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        P.born[P.workers + 1] = atomic_load(&P.gen);
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(P.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        P.workers++;
    }
    return P.workers;
}

void sd_parallel(int threads, int64_t items, int64_t chunk, sd_task fn, void *ctx) {
    if (chunk < 1) chunk = 1;
    if (threads > 1) threads = 1 + (start_workers(threads - 1) < threads - 1 ? P.workers : threads - 1);
    if (threads <= 1 || items <= chunk || P.alone > 0) {
        if (threads > 1 && items > chunk) P.alone--;
        for (int64_t i = 0; i < items; i++) fn(ctx, i, 0);
        return;
    }
    double start = now_us();
    P.current = (job){fn, ctx, items, chunk, threads};
    atomic_store(&P.next, 0);
    atomic_store(&P.pending, P.workers);
    atomic_fetch_add(&P.gen, 1);
    int woken = atomic_load(&P.sleepers) > 0; /* a wake-up is slow too, but no sign of another program */
    if (woken) {
        pthread_mutex_lock(&P.lock);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.lock);
    }
    run_items(0);
    double mine = now_us();
    /* The others finish their last chunk; yield the core if one of them is held back for long. */
    for (int spins = 1; atomic_load(&P.pending) > 0; spins++) {
        cpu_relax();
        if (spins % 4096 == 0) sched_yield();
    }
    double waited = now_us() - mine;
    if (!woken && waited > 50.0 && waited > mine - start) {
        P.alone = P.alone_next;
        P.alone_next = P.alone < ALONE_MOST / 2 ? 2 * P.alone : ALONE_MOST;
    } else if (!woken) {
        P.alone_next = ALONE_FIRST; /* on time again */
    }
}
