/* A decode window's or a prompt chunk's routed SwiGLU experts on the CPU in one call (engine/kernels/ops.py
 * `swiglu_experts`).
 *
 * Why in C: a layer of a MoE decode step is ~12 expert products plus the sort, the gathers, the silu
 * and the weighted sum, each a few microseconds of Python and torch dispatch; for a small model that
 * is most of the step (and of a prompt chunk, whose products are one per routed expert, 3 x 64 a
 * layer for the MoE demo). Here every routed expert runs its rows through sd_matmul's kernels
 * (quant_cpu.c: each expert's weights read once for the window), then each row sums its k outputs in its
 * own order of choices. A row's result depends on its own x and routing only: the products compute
 * every row as alone, and the silu and the sum are per row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu.h"
#include "pool.h"
#include "quant_cpu.h"

/* `bytes` of scratch kept from call to call (calls come from one thread at a time, as sd_parallel's), or NULL: a
 * prompt chunk's is ~100 MB at Qwen3-30B-A3B's shapes (512 rows), and fresh memory of that size pays its page
 * faults on every call (~10% of the call). It grows to the largest call's and stays. */
static void *scratch(size_t bytes) {
    static void *mem;
    static size_t size;
    return sd_kept(&mem, &size, bytes);
}

/* `count` products of one layout in one parallel region. */
static int products(const sd_product *p, int64_t count, int packed, int threads, int activations) {
    return packed ? sd_matmul_packed_many(p, count, threads, activations) : sd_matmul_many(p, count, threads, activations);
}

typedef struct {
    const float *x, *weights;
    const int64_t *at; /* where each pair's row landed */
    int64_t k, hidden, ff;
    float *xs, *g, *u, *h, *y, *out; /* as sd_swiglu_experts' scratch */
} steps;

static void gather_pair(void *ctx, int64_t p, int thread) {
    (void)thread;
    const steps *s = ctx;
    memcpy(s->xs + s->at[p] * s->hidden, s->x + p / s->k * s->hidden, sizeof(float) * (size_t)s->hidden);
}

static void gate_pair(void *ctx, int64_t p, int thread) {
    (void)thread;
    const steps *s = ctx;
    sd_gated(0, s->g + p * s->ff, s->ff, s->u + p * s->ff, s->ff, s->h + p * s->ff, 1, s->ff); /* silu(gate) * up */
}

static void sum_row(void *ctx, int64_t r, int thread) {
    (void)thread;
    const steps *s = ctx;
    float *o = s->out + r * s->hidden;
    for (int64_t v = 0; v < s->hidden; v++) o[v] = 0.0f;
    for (int64_t i = 0; i < s->k; i++) {
        const float *yp = s->y + s->at[r * s->k + i] * s->hidden;
        float w = s->weights[r * s->k + i];
        for (int64_t v = 0; v < s->hidden; v++) o[v] += w * yp[v];
    }
}

static void each(int threads, int64_t items, sd_task fn, steps *s) {
    sd_parallel(threads, items, items / (8 * threads) + 1, fn, s);
}

/* out[r] = sum over i of weights[r, i] * down_e(silu(gate_e(x[r])) * up_e(x[r])), e = ids[r, i], for the
 * m rows of x [m, hidden] with k experts each (i in order). gate and up hold `experts` matrices of ff rows
 * of `hidden` values, down `experts` of hidden rows of ff values, each stack's experts one after the
 * other, of the given GGUF types (| SD_PACKED: each matrix's rows packed by 16, sd_pack). Every routed expert's
 * gate and up products run in one parallel region (sd_matmul_many or sd_matmul_packed_many; two when only one of
 * them is packed), its down products in another: a region each would cost more than a small expert's product.
 * Returns 0, or -1 for a bad type or expert id, or no memory. */
int sd_swiglu_experts(int gate_type, const uint8_t *gate, int up_type, const uint8_t *up, int down_type,
                      const uint8_t *down, int64_t experts, int64_t ff, int64_t hidden, const float *x, int64_t m,
                      int64_t k, const int64_t *ids, const float *weights, float *out, int threads, int activations) {
    int gate_packed = gate_type & SD_PACKED, up_packed = up_type & SD_PACKED, down_packed = down_type & SD_PACKED;
    gate_type &= ~SD_PACKED, up_type &= ~SD_PACKED, down_type &= ~SD_PACKED;
    int64_t gb = sd_row_bytes(gate_type, hidden), ub = sd_row_bytes(up_type, hidden), db = sd_row_bytes(down_type, ff);
    int64_t pairs = m * k;
    if (gb < 0 || ub < 0 || db < 0) return -1;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= experts) return -1;
    /* scratch: the pairs' x rows grouped by expert (each expert's in row order), their gate, up and
     * silu(gate)*up rows and their outputs; where each pair landed; the products */
    float *xs = scratch(sizeof(float) * (size_t)(pairs * (2 * hidden + 3 * ff)));
    int64_t *at = malloc(sizeof(int64_t) * (size_t)pairs);
    sd_product *prods = malloc(sizeof(sd_product) * (size_t)(3 * pairs)); /* gates, ups, downs: pairs apart */
    int status = xs && at && prods ? 0 : -1;
    float *g = xs + pairs * hidden, *u = g + pairs * ff, *h = u + pairs * ff, *y = h + pairs * ff;
    int64_t n = 0, routed = 0; /* pairs placed so far, experts routed to */
    for (int64_t e = 0; e < experts && !status; e++) {
        int64_t from = n; /* the rows routed to e, in row order (a row routes an expert at most once) */
        for (int64_t p = 0; p < pairs; p++)
            if (ids[p] == e) at[p] = n++;
        if (n == from) continue;
        prods[routed] = (sd_product){gate_type, gate + e * ff * gb, ff, hidden, xs + from * hidden, n - from,
                                     g + from * ff};
        prods[pairs + routed] = (sd_product){up_type, up + e * ff * ub, ff, hidden, xs + from * hidden, n - from,
                                             u + from * ff};
        prods[2 * pairs + routed] = (sd_product){down_type, down + e * hidden * db, hidden, ff, h + from * ff,
                                                 n - from, y + from * hidden};
        routed++;
    }
    steps st = {.x = x, .weights = weights, .at = at, .k = k, .hidden = hidden, .ff = ff, .xs = xs, .g = g, .u = u,
                .h = h, .y = y, .out = out};
    int helpers = pairs * hidden > SD_CHUNK_FROM && threads > 1 ? threads : 1; /* a pair or a row an item */
    if (!status) each(helpers, pairs, gather_pair, &st);
    if (!status && gate_packed == up_packed) { /* the ups moved up behind the gates: one region */
        memmove(prods + routed, prods + pairs, sizeof(sd_product) * (size_t)routed);
        status = products(prods, 2 * routed, gate_packed, threads, activations);
    } else if (!status) {
        status = products(prods, routed, gate_packed, threads, activations);
        if (!status) status = products(prods + pairs, routed, up_packed, threads, activations);
    }
    if (!status) each(helpers, pairs, gate_pair, &st); /* silu(gate) * up, as the dense models' */
    if (!status) status = products(prods + 2 * pairs, routed, down_packed, threads, activations);
    if (!status) each(helpers, m, sum_row, &st);
    free(at), free(prods);
    return status ? -1 : 0;
}

typedef struct {
    const float *x, *router;
    int64_t hidden, experts, k;
    int normalize;
    int64_t m, per; /* per: rows an item takes (ROUTE_ROWS for a chunk, 1 for a decode window: over the threads) */
    float *weights, *probs; /* probs: ROUTE_ROWS rows of `experts` per thread */
    int64_t *ids;
    _Atomic int bad; /* a row met NaN logits */
} route_job;

#define ROUTE_ROWS 4 /* a chunk's rows an item takes: an expert's weights read from memory once for them all */

/* Row r's choices from its logits p (softmax, the k most likely, their weights). */
static void choose(route_job *j, int64_t r, float *p, float top) {
    float *weights = j->weights + r * j->k, sum = 0.0f;
    int64_t *ids = j->ids + r * j->k;
    for (int64_t e = 0; e < j->experts; e++) {
        p[e] = expf(p[e] - top);
        sum += p[e];
    }
    float chosen = 0.0f;
    for (int64_t c = 0; c < j->k; c++) {
        int64_t best = -1;
        for (int64_t e = 0; e < j->experts; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
        if (best < 0) { /* NaN probabilities */
            j->bad = 1;
            return;
        }
        ids[c] = best;
        weights[c] = p[best] / sum;
        chosen += weights[c];
        p[best] = -1.0f; /* taken */
    }
    if (j->normalize)
        for (int64_t c = 0; c < j->k; c++) weights[c] /= chosen;
}

/* x . w over n values in eight lanes added in a fixed tree: a row's logit does not depend on the rows beside it. */
static float dot(const float *x, const float *w, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += x[i + l] * w[i + l];
    float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < n; i++) sum += x[i] * w[i];
    return sum;
}

/* Rows j->per * b.. (fewer at the end), an expert's weights at a time: read from memory once for them all. */
static void route_rows(void *ctx, int64_t b, int thread) {
    route_job *j = ctx;
    int64_t r0 = b * j->per, rows = j->m - r0 < j->per ? j->m - r0 : j->per;
    float *p = j->probs + thread * ROUTE_ROWS * j->experts, top[ROUTE_ROWS];
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY;
    for (int64_t e = 0; e < j->experts; e++)
        for (int64_t r = 0; r < rows; r++) {
            float logit = dot(j->x + (r0 + r) * j->hidden, j->router + e * j->hidden, j->hidden);
            p[r * j->experts + e] = logit;
            if (logit > top[r]) top[r] = logit;
        }
    for (int64_t r = 0; r < rows && !j->bad; r++) choose(j, r0 + r, p + r * j->experts, top[r]);
}

/* The router of m rows (Qwen3-MoE order): logits = x [m, hidden] @ router [experts, hidden]^T, a softmax over each
 * row's logits, its k most likely experts (the first on ties) into ids [m, k] and their probabilities into
 * weights [m, k], divided by their sum (in the order of choices) when `normalize`. Each row on its own, in a fixed
 * order (rows split over threads: a prompt chunk's): a row routes alike in any window. Returns 0, or -1 for k outside
 * [1, experts], NaN logits or no memory. */
int sd_route(const float *x, int64_t m, int64_t hidden, const float *router, int64_t experts, int64_t k, int normalize,
             float *weights, int64_t *ids, int threads) {
    if (k < 1 || k > experts) return -1;
    if (threads < 1 || m < 2 * threads) threads = 1;
    float *probs = malloc(sizeof(float) * (size_t)(ROUTE_ROWS * experts * threads));
    if (!probs) return -1;
    route_job j = {.x = x, .router = router, .hidden = hidden, .experts = experts, .k = k, .normalize = normalize,
                   .m = m, .per = m >= 8 * threads ? ROUTE_ROWS : 1, .weights = weights, .probs = probs, .ids = ids};
    int64_t blocks = (m + j.per - 1) / j.per;
    sd_parallel(threads, blocks, blocks / (8 * threads) + 1, route_rows, &j);
    free(probs);
    return j.bad ? -1 : 0;
}
