/* The small float32 operations of a CPU decode step (engine/kernels/ops.py): RMSNorm, rotary
 * embedding (NEOX and llama.cpp's normal), a query row's attention over its session's cache (and a step's
 * rows from the batch's buffers), argmax, and the elementwise steps (gated activations, adds, scaling).
 *
 * Why in C: each is a handful of torch calls of a few microseconds of dispatch each (an RMSNorm of
 * 640 values: 43 us through torch on the 2-core test machine, ~1 us here), and a decode step makes
 * hundreds of them. Every result is computed in one fixed order from its own row's inputs, so rows
 * stay independent of each other (batch invariance). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f16.h"
#include "ops_cpu.h"
#include "pool.h"
#include "simd.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

/* KV_Q8_0 (engine/kv_blocks.py): each row of d values is d / 32 blocks of a float16 scale and 32 int8 values.
 * The functions below address a cache by element index i (row i / d, value i % d); the vector loads take 8
 * values of one block (i a multiple of 8, d of 32). */
static int64_t kv_row_bytes(int type, int64_t d) {
    return type == KV_Q8_0 ? d / 32 * 34 : type == KV_F32 ? d * 4 : d * 2;
}

static inline const uint8_t *q8_block(const void *p, int64_t i, int64_t d) {
    return (const uint8_t *)p + i / d * kv_row_bytes(KV_Q8_0, d) + i % d / 32 * 34;
}

static inline float q8_scale(const uint8_t *block) {
    uint16_t h;
    memcpy(&h, block, 2);
    return sd_f16(h);
}

#define ROWS_AN_ITEM 16 /* rows of the row-wise steps below a thread takes at a time */

/* 1 / sqrt(mean(a^2) + eps) over dim values: eight lanes of doubles (each product of floats exact), added in a
 * fixed tree, so a row's scale depends on its own values only. */
static float rms_scale(const float *a, int64_t dim, float eps) {
    double lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += (double)a[i + l] * a[i + l];
    double ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < dim; i++) ss += (double)a[i] * a[i];
    return (float)(1.0 / sqrt(ss / (double)dim + eps));
}

typedef struct {
    const float *x, *w;
    float *out;
    int64_t stride, groups, dim;
    float eps;
} norm_job;

static void norm_row(void *ctx, int64_t r, int thread) {
    const norm_job *j = ctx;
    (void)thread;
    float *out = j->out + r * j->groups * j->dim;
    for (int64_t g = 0; g < j->groups; g++, out += j->dim) {
        const float *a = j->x + r * j->stride + g * j->dim;
        float scale = rms_scale(a, j->dim, j->eps);
        for (int64_t i = 0; i < j->dim; i++) out[i] = a[i] * scale * j->w[i];
    }
}

/* out[r, g] = x[r, g] / sqrt(mean(x[r, g]^2) + eps) * w for `groups` runs of dim values a row (per-head
 * norms), row r of x at x + r * stride (the rows of a split product are strided), out contiguous; a prompt
 * chunk's rows over `threads`. */
void sd_rms_norm(const float *x, int64_t stride, const float *w, float *out, int64_t rows, int64_t groups,
                 int64_t dim, float eps, int threads) {
    norm_job j = {.x = x, .w = w, .out = out, .stride = stride, .groups = groups, .dim = dim, .eps = eps};
    sd_parallel(rows * groups * dim < SD_SPREAD_FROM ? 1 : threads, rows, ROWS_AN_ITEM, norm_row, &j);
}

typedef struct {
    const float *x, *cos_t, *sin_t;
    float *out;
    const int64_t *pos;
    int64_t stride, heads, dim;
    int neox;
} rope_job;

static void rope_row(void *ctx, int64_t r, int thread) {
    const rope_job *j = ctx;
    int64_t half = j->dim / 2;
    const float *c = j->cos_t + j->pos[r] * half, *s = j->sin_t + j->pos[r] * half;
    (void)thread;
    for (int64_t h = 0; h < j->heads; h++) {
        const float *a = j->x + r * j->stride + h * j->dim;
        float *o = j->out + (r * j->heads + h) * j->dim;
        if (j->neox) /* the halves apart: contiguous, so the loop vectorizes */
            for (int64_t i = 0; i < half; i++) {
                float x1 = a[i], x2 = a[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        else
            for (int64_t i = 0; i < half; i++) {
                float x1 = a[2 * i], x2 = a[2 * i + 1];
                o[2 * i] = x1 * c[i] - x2 * s[i];
                o[2 * i + 1] = x2 * c[i] + x1 * s[i];
            }
    }
}

/* Rotary embedding of x [rows, heads, dim] (row r at x + r * stride) at pos[r] into out [rows, heads, dim],
 * with tables cos/sin [positions, dim/2]. Pair i is (i, i + dim/2) when neox (rotate halves), else (2i, 2i + 1):
 * llama.cpp's "normal" rope, which GGUF llama files expect (their q/k rows are permuted for it). A prompt
 * chunk's rows over `threads`. */
void sd_rope(const float *x, int64_t stride, float *out, const int64_t *pos, int64_t rows, int64_t heads,
             int64_t dim, const float *cos_t, const float *sin_t, int neox, int threads) {
    rope_job j = {.x = x, .cos_t = cos_t, .sin_t = sin_t, .out = out, .pos = pos, .stride = stride, .heads = heads,
                  .dim = dim, .neox = neox};
    sd_parallel(rows * heads * dim < SD_SPREAD_FROM ? 1 : threads, rows, ROWS_AN_ITEM, rope_row, &j);
}

/* out[r] = the index of the first largest value of row r of x [rows, n] (NaNs are passed over). */
void sd_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++, x += n) {
        float best = -INFINITY;
        int64_t i = 0, at = 0;
#ifdef SD_AVX2
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
        for (; i < n; i++)
            if (x[i] > best) best = x[i];
#ifdef SD_AVX2
        /* its first index, 8 values a compare (value by value: ~150 us of a 262K vocabulary) */
        __m256 b = _mm256_set1_ps(best);
        for (; at + 8 <= n; at += 8) {
            int lanes = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + at), b, _CMP_GE_OQ));
            if (lanes) {
                at += __builtin_ctz((unsigned)lanes);
                break;
            }
        }
#endif
        while (at < n - 1 && !(x[at] >= best)) at++;
        out[r] = at;
    }
}

/* ---- one query row's attention ------------------------------------------------------------------ */

static inline float load_kv(const void *p, int type, int64_t i, int64_t d) {
    if (type == KV_F32) return ((const float *)p)[i];
    if (type == KV_Q8_0) {
        const uint8_t *b = q8_block(p, i, d);
        return q8_scale(b) * (float)(int8_t)b[2 + i % 32];
    }
    uint16_t h = ((const uint16_t *)p)[i];
    if (type == KV_BF16) {
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return sd_f16(h);
}

#ifdef SD_AVX2
static inline __m256 load8_kv(const void *p, int type, int64_t i, int64_t d) {
    if (type == KV_F32) return _mm256_loadu_ps((const float *)p + i);
    if (type == KV_Q8_0) {
        const uint8_t *b = q8_block(p, i, d);
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + i % 32))));
        return _mm256_mul_ps(_mm256_set1_ps(q8_scale(b)), q);
    }
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (type == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* q . k[i .. i+d) in a fixed order. */
static float dot_kv(const float *q, const void *k, int type, int64_t i, int64_t d) {
    int64_t j = 0;
    float acc = 0.0f;
#ifdef SD_AVX2
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    for (; j + 16 <= d; j += 16) {
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8_kv(k, type, i + j, d), c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), load8_kv(k, type, i + j + 8, d), c1);
    }
    acc = hsum8(_mm256_add_ps(c0, c1));
#endif
    for (; j < d; j++) acc += q[j] * load_kv(k, type, i + j, d);
    return acc;
}

/* out[0 .. d) += p * v[i .. i+d) */
static void axpy_kv(float *out, float p, const void *v, int type, int64_t i, int64_t d) {
    int64_t j = 0;
#ifdef SD_AVX2
    __m256 vp = _mm256_set1_ps(p);
    for (; j + 8 <= d; j += 8)
        _mm256_storeu_ps(out + j, _mm256_fmadd_ps(vp, load8_kv(v, type, i + j, d), _mm256_loadu_ps(out + j)));
#endif
    for (; j < d; j++) out[j] += p * load_kv(v, type, i + j, d);
}

/* out[0 .. d) += p[0] * v[i[0] ..) then p[1] * v[i[1] ..) ... p[3]: axpy_kv four times, each element's
 * updates in the same order (the same bits), with out read and written once instead of four times. */
static void axpy4_kv(float *out, const float p[4], const void *v, int type, const int64_t i[4], int64_t d) {
    int64_t j = 0;
#ifdef SD_AVX2
    __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(p[1]), p2 = _mm256_set1_ps(p[2]), p3 = _mm256_set1_ps(p[3]);
    for (; j + 8 <= d; j += 8) {
        __m256 o = _mm256_fmadd_ps(p0, load8_kv(v, type, i[0] + j, d), _mm256_loadu_ps(out + j));
        o = _mm256_fmadd_ps(p1, load8_kv(v, type, i[1] + j, d), o);
        o = _mm256_fmadd_ps(p2, load8_kv(v, type, i[2] + j, d), o);
        _mm256_storeu_ps(out + j, _mm256_fmadd_ps(p3, load8_kv(v, type, i[3] + j, d), o));
    }
#endif
    for (; j < d; j++)
        for (int r = 0; r < 4; r++) out[j] += p[r] * load_kv(v, type, i[r] + j, d);
}

/* Positions an item of a row's attention takes: a fixed split, whatever the threads, so the same bits on any
 * number of them. */
#define ATTEND_CHUNK 64

typedef struct {
    const float *q;
    const void *k, *v;
    int type;
    int64_t heads, kv_heads, d, ring, lo, hi, chunks;
    float scale;
    float *part; /* per head and chunk: the chunk's d weighted values, its largest score, its sum of weights */
    float *out;  /* [heads, d] */
} attend_job;

/* Chunk c of kv head g's positions for every query head that shares g, each key and value row read from memory
 * once for all of them (then from L1): scores, their softmax within the chunk, the weighted values. */
static void attend_chunk(void *ctx, int64_t item, int thread) {
    const attend_job *a = ctx;
    (void)thread;
    int64_t group = a->heads / a->kv_heads, g = item / a->chunks, c = item % a->chunks;
    int64_t from = a->lo + c * ATTEND_CHUNK, n = a->hi - from < ATTEND_CHUNK ? a->hi - from : ATTEND_CHUNK;
    int64_t at[ATTEND_CHUNK];
    float s[ATTEND_CHUNK];
    for (int64_t t = 0; t < n; t++) at[t] = (g * a->ring + (from + t) % a->ring) * a->d;
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        const float *q = a->q + h * a->d;
        float *out = a->part + (h * a->chunks + c) * (a->d + 2), top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            s[t] = dot_kv(q, a->k, a->type, at[t], a->d) * a->scale;
            if (s[t] > top) top = s[t];
        }
        for (int64_t t = 0; t < n; t++) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        memset(out, 0, (size_t)a->d * sizeof(float));
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) axpy4_kv(out, s + t, a->v, a->type, at + t, a->d);
        for (; t < n; t++) axpy_kv(out, s[t], a->v, a->type, at[t], a->d);
        out[a->d] = top;
        out[a->d + 1] = sum;
    }
}

/* Head h's chunks merged in order: each chunk's weighted values rescaled to the largest score of all. */
static void attend_merge(void *ctx, int64_t h, int thread) {
    const attend_job *a = ctx;
    (void)thread;
    const float *part = a->part + h * a->chunks * (a->d + 2);
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < a->chunks; c++)
        if (part[c * (a->d + 2) + a->d] > top) top = part[c * (a->d + 2) + a->d];
    float *dst = a->out + h * a->d;
    memset(dst, 0, (size_t)a->d * sizeof(float));
    for (int64_t c = 0; c < a->chunks; c++) {
        const float *src = part + c * (a->d + 2);
        float w = expf(src[a->d] - top);
        total += w * src[a->d + 1];
        axpy_kv(dst, w, src, KV_F32, 0, a->d);
    }
    for (int64_t j = 0; j < a->d; j++) dst[j] /= total;
}

/* One row of d values into a Q8_0 row, as ggml's reference quantizer (and gguf-py) rounds them. */
static void store_q8_0(uint8_t *dst, const float *src, int64_t d) {
    for (int64_t b = 0; b < d / 32; b++, src += 32, dst += 34) {
        float top = 0.0f;
        for (int j = 0; j < 32; j++) top = fmaxf(top, fabsf(src[j]));
        float scale = top / 127, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        uint16_t h = sd_to_f16(scale);
        memcpy(dst, &h, 2);
        for (int j = 0; j < 32; j++) dst[2 + j] = (uint8_t)(int8_t)roundf(src[j] * inverse);
    }
}

static void store_kv(void *dst, int type, const float *src, int64_t d) {
    if (type == KV_Q8_0) {
        store_q8_0(dst, src, d);
        return;
    }
    for (int64_t j = 0; j < d; j++) {
        if (type == KV_F32) {
            ((float *)dst)[j] = src[j];
        } else if (type == KV_F16) {
            ((uint16_t *)dst)[j] = sd_to_f16(src[j]);
        } else {
            ((uint16_t *)dst)[j] = sd_to_bf16(src[j]);
        }
    }
}

/* One decode row: its key and value k_new, v_new [kv_heads, d] are stored at position hi - 1 of the
 * session's cache k, v [kv_heads, ring, d] (position p in slot p % ring), then its query q [heads, d]
 * attends over positions lo..hi-1 -> out [heads, d]; heads split over threads. Returns -1 without
 * memory. */
int sd_attend_row(const float *q, const float *k_new, const float *v_new, int64_t heads, int64_t kv_heads,
                  int64_t d, void *k, void *v, int type, int64_t ring, int64_t lo, int64_t hi, float scale,
                  float *out, int threads) {
    int64_t n = hi - lo, row = kv_row_bytes(type, d);
    for (int64_t h = 0; h < kv_heads; h++) {
        int64_t at = (h * ring + (hi - 1) % ring) * row;
        store_kv((char *)k + at, type, k_new + h * d, d);
        store_kv((char *)v + at, type, v_new + h * d, d);
    }
    if (n <= 0) {
        memset(out, 0, (size_t)(heads * d) * sizeof(float));
        return 0;
    }
    int64_t chunks = (n + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
    float *part = malloc((size_t)(heads * chunks * (d + 2)) * sizeof(float));
    if (!part) return -1;
    attend_job a = {q, k, v, type, heads, kv_heads, d, ring, lo, hi, chunks, scale, part, out};
    if (heads * n * d < SD_SPREAD_FROM) threads = 1;
    sd_parallel(threads, kv_heads * chunks, 1, attend_chunk, &a);
    sd_parallel(chunks > 1 ? threads : 1, heads, 1, attend_merge, &a);
    free(part);
    return 0;
}

/* A decode step's attention, every row from the batch's buffers (engine/batch.py): row r (q, k, v at
 * r * q_stride ..., [heads or kv_heads, d] each) is session sessions[r]'s token at position pos[r], over that
 * session's cache (k, v [sessions, kv_heads, ring, d]) as sd_attend_row computes it alone; `window` > 0 limits
 * it to the last `window` positions. Nothing here is a host value of the step, so a recorded step replays it
 * (engine/cpu_plans.py). out [rows, heads * d]. Returns -1 without memory. */
int sd_attend_rows(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, int64_t rows, const int64_t *sessions, const int64_t *pos, int64_t heads,
                   int64_t kv_heads, int64_t d, void *k_cache, void *v_cache, int type, int64_t ring, int64_t window,
                   float scale, float *out, int threads) {
    int64_t session_bytes = kv_heads * ring * kv_row_bytes(type, d);
    for (int64_t r = 0; r < rows; r++) {
        int64_t lo = window > 0 && pos[r] - window + 1 > 0 ? pos[r] - window + 1 : 0;
        if (sd_attend_row(q + r * q_stride, k + r * k_stride, v + r * v_stride, heads, kv_heads, d,
                          (char *)k_cache + sessions[r] * session_bytes, (char *)v_cache + sessions[r] * session_bytes,
                          type, ring, lo, pos[r] + 1, scale, out + r * heads * d, threads))
            return -1;
    }
    return 0;
}

/* ---- elementwise ---------------------------------------------------------------------------------- */
/* Why in C: each of these replaces a torch call of a few microseconds of dispatch in a decode step (the gated
 * activation of 2,048 values takes about a microsecond here). Every element's result depends only on its own
 * inputs: the vector loops and the scalar tails (and builds without SD_AVX2) do the same float operations (fmaf
 * for each FMA: a library call, ~30x slower, where the CPU has none). */

/* exp(t) for the sigmoids below, Cephes' expf: n = round(t log2 e) (by adding 1.5 * 2^23), r = t - n ln2 in two
 * parts (|r| <= ln2 / 2), e^r = 1 + r + r^2 p(r), 2^n by its exponent bits. t is clamped to [-87.3, 89] (never NaN):
 * a normal float from t = -87.3 and inf from t = 88.38 on (2^128: exponent bits all ones), a little before
 * expf overflows (88.72), harmless in x / (1 + exp(t)), which is then -0 or 0. */
#define EXP_LO (-87.3f)
#define EXP_HI 89.0f
#define EXP_ROUND 12582912.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
/* GELU (tanh) is x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): x / (1 + e^t), t = x (GELU_A + GELU_B x^2). */
#define GELU_A (-1.59576912160573071f)  /* -2 sqrt(2/pi) */
#define GELU_B (-0.0713548162726008963f) /* -2 sqrt(2/pi) 0.044715 */

static inline float exp_clamped(float t) {
    t = t > EXP_LO ? t : EXP_LO; /* _mm256_max_ps, _mm256_min_ps */
    t = t < EXP_HI ? t : EXP_HI;
    float n = fmaf(t, EXP_LOG2E, EXP_ROUND) - EXP_ROUND;
    float r = fmaf(n, -EXP_LN2_LO, fmaf(n, -EXP_LN2_HI, t));
    float p = fmaf(fmaf(fmaf(fmaf(fmaf(EXP_P0, r, EXP_P1), r, EXP_P2), r, EXP_P3), r, EXP_P4), r, EXP_P5);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return (fmaf(p, r * r, r) + 1.0f) * two_n;
}

static inline float gated_one(int kind, float x) {
    return x / (1.0f + exp_clamped(kind ? x * fmaf(GELU_B, x * x, GELU_A) : -x));
}

#ifdef SD_AVX2
static inline __m256 exp8_clamped(__m256 t) {
    const __m256 round = _mm256_set1_ps(EXP_ROUND);
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(t, _mm256_set1_ps(EXP_LOG2E), round), round);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), t);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(EXP_P0), r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 gated8(int kind, __m256 x) {
    __m256 t = kind ? _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(GELU_B), _mm256_mul_ps(x, x),
                                                       _mm256_set1_ps(GELU_A)))
                    : _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8_clamped(t)));
}
#endif

/* out[r, i] = act(gate[r * gate_stride + i]) * up[r * up_stride + i] for rows of n values: act SiLU (kind 0) or
 * GELU with the tanh approximation (kind 1), each as x / (1 + exp(.)): no cancellation for negative x. */
void sd_gated(int kind, const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
              int64_t rows, int64_t n) {
    kind = kind != 0;
    for (int64_t r = 0; r < rows; r++, gate += gate_stride, up += up_stride, out += n) {
        int64_t i = 0;
#ifdef SD_AVX2
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(gated8(kind, _mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
#endif
        for (; i < n; i++) out[i] = gated_one(kind, gate[i]) * up[i];
    }
}

/* out = x + r, count values. */
void sd_add(const float *x, const float *r, float *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = x[i] + r[i];
}

/* sum = x + r and normed = sd_rms_norm(sum, w), rows of dim values: a residual add and the next layer's norm. */
void sd_add_rms_norm(const float *x, const float *r, const float *w, float *sum, float *normed, int64_t rows,
                     int64_t dim, float eps, int threads) {
    sd_add(x, r, sum, rows * dim);
    sd_rms_norm(sum, dim, w, normed, rows, 1, dim, eps, threads);
}

/* out = x * s, count values. */
void sd_scale(const float *x, float s, float *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = x[i] * s;
}
