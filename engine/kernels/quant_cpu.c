/* CPU kernels for GGUF weights: row dequantizers for the ggml types and a decode-sized matmul.
 *
 * Plain C, with AVX2/FMA/F16C intrinsics where the compiler targets them (portable C otherwise, or
 * with -DSD_PORTABLE), threads from pool.c. Built by engine/kernels/cpu.py with -O3 -march=native
 * -ffp-contract=off.
 *
 * Floating point is exact on purpose:
 *  - contraction is off, so the dequantizers round `d*q` before adding the minimum as gguf-py's
 *    numpy reference does, and give bit-identical results;
 *  - the only FMAs are explicit, and every path of sd_matmul computes y[i, j] with the same
 *    sequence: for each group of 32 values g = 0, 32, 64, ... and v = 0..3, c[v % 2] +=
 *    W[j, g+8v .. g+8v+8] * x[i, g+8v .. g+8v+8] on two 8-lane accumulators, then one fixed
 *    reduction (and, for float types with k not a multiple of 32, a scalar tail; the portable
 *    build has its own single order). So y[i, j] depends on W[j] and x[i] only: not on m, on which
 *    rows share a pass, on the path taken or on the thread split (batch invariance).
 *  - integer modes (AVX2 only) first round each x row to int16 (scale max|x|/32767) or int8 (scale
 *    max|x|/127, llama.cpp's rounding) per block of 32 (per super-block of 256 for Q4_K/Q5_K/Q6_K),
 *    then take integer dot products of each block: y[i, j] = the fixed-order sum over blocks of
 *    float(int dot) * (weight scale * x scale), plus the minimums' terms in a separate sum. The K
 *    types above sum a whole super-block (their sub-block scales applied in integers) before the
 *    one float product. Fewer instructions than widening every weight to float; int16 rounds x by
 *    1.5e-5 of each block's largest |x|, int8 by 4e-3 for half the multiply-adds (32 byte pairs
 *    an instruction instead of 16 int16 pairs); both still a function of W[j] and x[i] only.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "f16.h"
#include "pool.h"
#include "quant_cpu.h"
#include "simd.h"

#define QK 32
#define QK_K 256

/* ---- scalar helpers ---------------------------------------------------------------------------- */


static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* ---- 32 int8 lanes ------------------------------------------------------------------------------
 * Every block type is unpacked 32 values at a time into int8 lanes (q32), then scaled. */

#ifdef SD_AVX2
typedef __m256i q32;
static inline q32 load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline q32 bytes32(int v) { return _mm256_set1_epi8((char)v); }
static inline q32 and32(q32 a, q32 b) { return _mm256_and_si256(a, b); }
static inline q32 or32(q32 a, q32 b) { return _mm256_or_si256(a, b); }
static inline q32 sub32(q32 a, q32 b) { return _mm256_sub_epi8(a, b); }
/* ~a & b */
static inline q32 andnot32(q32 a, q32 b) { return _mm256_andnot_si256(a, b); }
/* Each byte shifted by s; bits shifted in from the neighbouring byte are for the caller to mask off. */
static inline q32 shr32(q32 a, int s) { return _mm256_srli_epi16(a, s); }
static inline q32 shl32(q32 a, int s) { return _mm256_slli_epi16(a, s); }
/* 0xff in the bytes where (a & bit) != 0, else 0. */
static inline q32 has32(q32 a, int bit) { return _mm256_cmpeq_epi8(and32(a, bytes32(bit)), bytes32(bit)); }

/* 16 bytes of nibbles: low nibbles are values 0..15, high nibbles 16..31. */
static inline q32 nibbles32(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* 0x10 in byte l where bit l of qh is set. */
static inline q32 high_bits32(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    return and32(_mm256_cmpeq_epi8(and32(v, bit), bit), bytes32(0x10));
}

#else
typedef struct { int8_t v[32]; } q32;
static inline q32 load32(const uint8_t *p) { q32 r; memcpy(r.v, p, 32); return r; }
static inline q32 bytes32(int v) { q32 r; memset(r.v, v, 32); return r; }
#define Q32_OP(name, expr) \
    static inline q32 name(q32 a, q32 b) { q32 r; for (int l = 0; l < 32; l++) r.v[l] = (int8_t)(expr); return r; }
Q32_OP(and32, a.v[l] & b.v[l])
Q32_OP(or32, a.v[l] | b.v[l])
Q32_OP(sub32, a.v[l] - b.v[l])
Q32_OP(andnot32, ~a.v[l] & b.v[l])
static inline q32 shr32(q32 a, int s) { for (int l = 0; l < 32; l++) a.v[l] = (int8_t)((uint8_t)a.v[l] >> s); return a; }
static inline q32 shl32(q32 a, int s) { for (int l = 0; l < 32; l++) a.v[l] = (int8_t)((uint8_t)a.v[l] << s); return a; }
static inline q32 has32(q32 a, int bit) { for (int l = 0; l < 32; l++) a.v[l] = (a.v[l] & bit) ? -1 : 0; return a; }

static inline q32 nibbles32(const uint8_t *qs) {
    q32 r;
    for (int l = 0; l < 16; l++) {
        r.v[l] = (int8_t)(qs[l] & 15);
        r.v[l + 16] = (int8_t)(qs[l] >> 4);
    }
    return r;
}

static inline q32 high_bits32(uint32_t qh) {
    q32 r;
    for (int l = 0; l < 32; l++) r.v[l] = (int8_t)(((qh >> l) & 1) << 4);
    return r;
}
#endif

/* ---- sinks: where 32 dequantized values go ------------------------------------------------------
 * A block walker (blk_<type> below) hands each group of 32 values, as int8 lanes and scales, to
 *   emit_scale:  w[l] = d * q[l]          (d0 for l < 16, d1 for the rest: K types scale per 16)
 *   emit_affine: w[l] = d * q[l] - m      (the product rounded first, as in the reference)
 * which store w (mode STORE: dequantize) or, with AVX2, multiply-add it into the dot products of
 * 1 to 4 x rows (mode = the number of rows, | INT16 or INT8 for x rows rounded to integers) without
 * going through memory. The walkers are always inlined with a constant mode, so each (type, mode)
 * compiles to its own loop. */

enum { STORE = 0, MAX_ROWS = 4, INT16 = 8, INT8 = 16 };
#define ROWS(mode) ((mode) & 7)
#define INTEGER(mode) ((mode) & (INT16 | INT8))

/* The x rows of a product: float32 [rows, k], or (integer modes) their int16 or int8 blocks q or q8
 * [rows, k], a scale per `block` values d [rows, k / block] (32, or QK_K for the K types whose
 * kernels sum a whole super-block in integers) and the sum of each 16 values of q, s [rows, k / 16]. */
typedef struct {
    const float *f;
    const int16_t *q;
    const int8_t *q8;
    const float *d;
    const int32_t *s;
    int64_t k, block;
} xrows;

#ifdef SD_AVX2
typedef struct {
    float *dst;
    const xrows *x;
    __m256 c[MAX_ROWS][2];
    float cm[MAX_ROWS];   /* integer modes: the minimums' terms */
    __m256 cmv[MAX_ROWS]; /* ... of the K types summed per super-block */
} sink;

INLINE void emit(sink *s, int mode, const __m256 w[4], int64_t off) {
    for (int v = 0; v < 4; v++) {
        if (mode == STORE) {
            _mm256_storeu_ps(s->dst + off + 8 * v, w[v]);
            continue;
        }
        for (int r = 0; r < mode; r++)
            s->c[r][v & 1] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(s->x->f + r * s->x->k + off + 8 * v), s->c[r][v & 1]);
    }
}

INLINE void to_float32(q32 q, __m256 f[4]) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

/* Integer modes, affine types: x row r's sums of block b (values 0-15, 16-31) times the minimums. */
INLINE void minimums(sink *s, int r, int64_t b, float dx, float m0, float m1) {
    const int32_t *sums = s->x->s + r * (s->x->k / 16) + 2 * b;
    s->cm[r] -= dx * (m0 * (float)sums[0] + m1 * (float)sums[1]);
}

/* integer mode: per x row, the integer dot products of q with the row's int16 block at off (values
 * 0-15 and 16-31 apart), scaled by d0 and d1 times the row's scale (one product when d0 == d1). q is
 * signed (scale types) or unsigned 0..63 (affine types, whose minimum m0/m1 is applied through the
 * block's sums). */
INLINE void emit_int(sink *s, int rows, q32 q, int is_signed, int one_scale, float d0, float m0, float d1, float m1,
                     int64_t off) {
    const xrows *x = s->x;
    int64_t b = off / 32; /* x->block is 32 here */
    __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    for (int r = 0; r < rows; r++) {
        const int16_t *xq = x->q + r * x->k + off;
        __m256i p0 = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
        __m256i p1 = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16)));
        float dx = x->d[r * (x->k / 32) + b];
        if (one_scale) {
            s->c[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(d0 * dx), s->c[r][0]);
        } else {
            s->c[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * dx), s->c[r][0]);
            s->c[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * dx), s->c[r][1]);
        }
        if (!is_signed) minimums(s, r, b, dx, m0, m1);
    }
}

/* int8 mode: as emit_int, with x row r's int8 block at off: byte-pair multiply-adds (the weights'
 * magnitudes against x with the weights' signs when q is signed), then pairs of pairs; values 0-15
 * land in lanes 0-3 and 16-31 in lanes 4-7, so two scales are one vector. */
INLINE void emit_i8(sink *s, int rows, q32 q, int is_signed, float d0, float m0, float d1, float m1, int64_t off) {
    const xrows *x = s->x;
    int64_t b = off / 32; /* x->block is 32 here */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i mag = is_signed ? _mm256_abs_epi8(q) : q;
    for (int r = 0; r < rows; r++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q8 + r * x->k + off));
        if (is_signed) xv = _mm256_sign_epi8(xv, q);
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xv), ones);
        float dx = x->d[r * (x->k / 32) + b];
        __m256 scale = _mm256_set_m128(_mm_set1_ps(d1 * dx), _mm_set1_ps(d0 * dx));
        s->c[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, s->c[r][0]);
        if (!is_signed) minimums(s, r, b, dx, m0, m1);
    }
}

INLINE void emit_scale(sink *s, int mode, q32 q, int one_scale, float d0, float d1, int64_t off) {
    if (mode & INT16) {
        emit_int(s, ROWS(mode), q, 1, one_scale, d0, 0.0f, d1, 0.0f, off);
        return;
    }
    if (mode & INT8) {
        emit_i8(s, ROWS(mode), q, 1, d0, 0.0f, d1, 0.0f, off);
        return;
    }
    __m256 w[4], a = _mm256_set1_ps(d0), b = _mm256_set1_ps(d1);
    to_float32(q, w);
    for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(w[v], v < 2 ? a : b);
    emit(s, mode, w, off);
}

INLINE void emit_affine(sink *s, int mode, q32 q, int one_scale, float d0, float m0, float d1, float m1,
                        int64_t off) {
    if (mode & INT16) {
        emit_int(s, ROWS(mode), q, 0, one_scale, d0, m0, d1, m1, off);
        return;
    }
    if (mode & INT8) {
        emit_i8(s, ROWS(mode), q, 0, d0, m0, d1, m1, off);
        return;
    }
    __m256 w[4], a = _mm256_set1_ps(d0), b = _mm256_set1_ps(d1), ma = _mm256_set1_ps(m0), mb = _mm256_set1_ps(m1);
    to_float32(q, w);
    for (int v = 0; v < 4; v++) w[v] = _mm256_sub_ps(_mm256_mul_ps(w[v], v < 2 ? a : b), v < 2 ? ma : mb);
    emit(s, mode, w, off);
}

#else
typedef struct { float *dst; } sink; /* portable build: STORE only */

INLINE void emit_scale(sink *s, int mode, q32 q, int one_scale, float d0, float d1, int64_t off) {
    (void)mode, (void)one_scale;
    for (int l = 0; l < 32; l++) s->dst[off + l] = (l < 16 ? d0 : d1) * (float)q.v[l];
}

INLINE void emit_affine(sink *s, int mode, q32 q, int one_scale, float d0, float m0, float d1, float m1,
                        int64_t off) {
    (void)mode, (void)one_scale;
    for (int l = 0; l < 32; l++) s->dst[off + l] = (l < 16 ? d0 : d1) * (float)q.v[l] - (l < 16 ? m0 : m1);
}
#endif

/* ---- K-type values, 32 at a time, as every path reads them --------------------------------------- */

/* Sub-block j (0..7) of a Q4_K / Q5_K block: nibble j%2 of qs[(j/2)*32 + l]; with qh (Q5_K's fifth
 * bits, loaded), bit j of qh[l] as bit 4. */
INLINE q32 k45_values(const uint8_t *qs, const q32 *qh, int j) {
    q32 q = and32(shr32(load32(qs + (j / 2) * 32), 4 * (j % 2)), bytes32(15));
    return qh ? or32(q, and32(has32(*qh, 1 << j), bytes32(16))) : q;
}

/* Values h*128 + g*32 .. +32 of a Q6_K block, minus 32: nibble g/2 of ql[h*64 + (g%2)*32 + l], bits
 * 2g..2g+1 of qh[h*32 + l] (loaded) on top. */
INLINE q32 q6_values(const uint8_t *src, q32 qh, int h, int g) {
    q32 lo = and32(shr32(load32(src + h * 64 + (g % 2) * 32), 4 * (g / 2)), bytes32(15));
    q32 hi = and32(g < 2 ? shl32(qh, 4 - 2 * g) : shr32(qh, 2 * g - 4), bytes32(0x30));
    return sub32(or32(lo, hi), bytes32(32));
}

#ifdef SD_AVX2
/* ---- integer super-blocks (K types, integer modes) ---------------------------------------------
 * With x rounded per super-block (x->block == QK_K), a Q4_K/Q5_K/Q6_K block's dot product is summed
 * in integers, one float product per super-block, the minimums through x's sums:
 *  - int16: each 32 weights times their sub-block scale (at most 1953 * 32767 per product, 32
 *    products a lane: below 2^31), multiply-added with x (Q6_K, whose signed scales allow 16
 *    products a lane: a float product per half);
 *  - int8: byte-pair multiply-adds of the weights with x, then pairs of those times the scales. */

/* 32 int16 weights (lo/hi: values 0-15, 16-31) times x row r's 32 values at off, added to acc. */
INLINE __m256i madd32(__m256i acc, __m256i lo, __m256i hi, const xrows *x, int r, int64_t off) {
    const int16_t *xq = x->q + r * x->k + off;
    __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                 _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
    return _mm256_add_epi32(acc, p);
}

/* 32 int8 weights (|w| when signed) times x row r's 32 int8 values at off (their signs moved by
 * sign_of when signed), pairs of pairs times scales (int16: values 0-15 in lanes 0-7, 16-31 in
 * lanes 8-15), added to acc. */
INLINE __m256i madd32_i8(__m256i acc, __m256i mag, __m256i sign_of, int is_signed, __m256i scales,
                         const xrows *x, int r, int64_t off) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q8 + r * x->k + off));
    if (is_signed) xv = _mm256_sign_epi8(xv, sign_of);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xv), scales));
}

INLINE float x_scale(const xrows *x, int r, int64_t o) { return x->d[r * (x->k / QK_K) + o / QK_K]; }

/* The sums of x row r's 8 runs of 32 values from off (a super-block), int32 in order. */
INLINE __m256i x_sums32(const xrows *x, int r, int64_t off) {
    const int32_t *sums = x->s + r * (x->k / 16) + off / 16;
    __m256i pairs = _mm256_hadd_epi32(_mm256_loadu_si256((const __m256i *)sums),
                                      _mm256_loadu_si256((const __m256i *)(sums + 8)));
    return _mm256_permute4x64_epi64(pairs, 0xd8); /* hadd's order 0 1 4 5 2 3 6 7 back to 0..7 */
}

/* Q4_K (qh_bytes NULL) and Q5_K (qh_bytes: the fifth bits). */
INLINE void sb_q45_k(const uint8_t *src, const uint8_t *qs, const uint8_t *qh_bytes, sink *s, int mode, int64_t o) {
    const xrows *x = s->x;
    int rows = ROWS(mode);
    float d = sd_f16_at(src), dmin = sd_f16_at(src + 2);
    uint8_t sc[8], mn[8];
    sd_k4_scales_mins(src + 4, sc, mn);
    __m256i acc[MAX_ROWS];
    q32 qh = qh_bytes ? load32(qh_bytes) : bytes32(0);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        q32 q = k45_values(qs, qh_bytes ? &qh : NULL, j);
        __m256i scale = _mm256_set1_epi16((short)sc[j]);
        if (mode & INT8) {
            for (int r = 0; r < rows; r++) acc[r] = madd32_i8(acc[r], q, q, 0, scale, x, r, o + 32 * j);
        } else {
            __m256i lo = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), scale);
            __m256i hi = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), scale);
            for (int r = 0; r < rows; r++) acc[r] = madd32(acc[r], lo, hi, x, r, o + 32 * j);
        }
    }
    __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn));
    for (int r = 0; r < rows; r++) {
        float dx = x_scale(x, r, o);
        s->c[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * dx), s->c[r][0]);
        __m256i m = _mm256_mullo_epi32(mins, x_sums32(x, r, o));
        s->cmv[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * dx), s->cmv[r]);
    }
}

INLINE void sb_q6_k(const uint8_t *src, sink *s, int mode, int64_t o) {
    const xrows *x = s->x;
    int rows = ROWS(mode);
    float d = sd_f16_at(src + 208);
    /* the 16 scales as int16; a pair of them (sub-blocks j, j + 1) is 32-bit word j / 2 */
    __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + 192)));
    const __m256i first = _mm256_set1_epi16(0x0100), second = _mm256_set1_epi16(0x0302);
    const __m256i halves = _mm256_set_m128i(_mm_set1_epi16(0x0302), _mm_set1_epi16(0x0100));
    __m256i acc[MAX_ROWS];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        if (h == 0 || !(mode & INT8))
            for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
        q32 qh = load32(src + 128 + h * 32);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            q32 q = q6_values(src, qh, h, g);
            int64_t off = o + h * 128 + g * 32;
            __m256i pair = _mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(h * 4 + g));
            if (mode & INT8) {
                __m256i mag = _mm256_abs_epi8(q), sc = _mm256_shuffle_epi8(pair, halves);
                for (int r = 0; r < rows; r++) acc[r] = madd32_i8(acc[r], mag, q, 1, sc, x, r, off);
            } else {
                __m256i lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
                                                _mm256_shuffle_epi8(pair, first));
                __m256i hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)),
                                                _mm256_shuffle_epi8(pair, second));
                for (int r = 0; r < rows; r++) acc[r] = madd32(acc[r], lo, hi, x, r, off);
            }
        }
        if (h == 1 || !(mode & INT8))
            for (int r = 0; r < rows; r++)
                s->c[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * x_scale(x, r, o)),
                                             s->c[r][h]);
    }
}
#endif

/* ---- block walkers: the values of one block, at offset o in the row ------------------------------ */

/* Q8_0: f16 d, int8 q[32]; w = d*q. */
INLINE void blk_q8_0(const uint8_t *src, sink *s, int mode, int64_t o) {
    float d = sd_f16_at(src);
#ifdef SD_AVX2 /* widening straight from memory saves the shuffles of emit_scale's to_float32 */
    if (INTEGER(mode)) {
        emit_scale(s, mode, load32(src + 2), 1, d, d, o);
        return;
    }
    __m256 w[4], vd = _mm256_set1_ps(d);
    for (int v = 0; v < 4; v++) {
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 2 + 8 * v)));
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), vd);
    }
    emit(s, mode, w, o);
#else
    emit_scale(s, mode, load32(src + 2), 1, d, d, o);
#endif
}

/* Q4_0: f16 d, qs[16] nibbles; w = d*(q-8). */
INLINE void blk_q4_0(const uint8_t *src, sink *s, int mode, int64_t o) {
    float d = sd_f16_at(src);
    emit_scale(s, mode, sub32(nibbles32(src + 2), bytes32(8)), 1, d, d, o);
}

/* Q4_1: f16 d, f16 m, qs[16]; w = d*q + m. */
INLINE void blk_q4_1(const uint8_t *src, sink *s, int mode, int64_t o) {
    float d = sd_f16_at(src), m = -sd_f16_at(src + 2);
    emit_affine(s, mode, nibbles32(src + 4), 1, d, m, d, m, o);
}

/* Q5_0: f16 d, qh (bit l: bit 4 of value l), qs[16]; w = d*(q-16). */
INLINE void blk_q5_0(const uint8_t *src, sink *s, int mode, int64_t o) {
    float d = sd_f16_at(src);
    q32 q = or32(nibbles32(src + 6), high_bits32(le32(src + 2)));
    emit_scale(s, mode, sub32(q, bytes32(16)), 1, d, d, o);
}

/* Q5_1: f16 d, f16 m, qh, qs[16]; w = d*q + m. */
INLINE void blk_q5_1(const uint8_t *src, sink *s, int mode, int64_t o) {
    float d = sd_f16_at(src), m = -sd_f16_at(src + 2);
    emit_affine(s, mode, or32(nibbles32(src + 8), high_bits32(le32(src + 4))), 1, d, m, d, m, o);
}

/* Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
 * Values g*32 + l (g < 8) are bits 2(g%4).. of qs[(g/4)*32 + l]; a scale and min per 16 values. */
INLINE void blk_q2_k(const uint8_t *src, sink *s, int mode, int64_t o) {
    float d = sd_f16_at(src + 80), dmin = sd_f16_at(src + 82);
    for (int g = 0; g < 8; g++) {
        q32 q = and32(shr32(load32(src + 16 + (g / 4) * 32), 2 * (g % 4)), bytes32(3));
        uint8_t s0 = src[2 * g], s1 = src[2 * g + 1];
        emit_affine(s, mode, q, 0, d * (float)(s0 & 15), dmin * (float)(s0 >> 4), d * (float)(s1 & 15),
                    dmin * (float)(s1 >> 4), o + 32 * g);
    }
}

/* Q3_K: hmask[32], qs[64], scales[12] (16 6-bit scales, offset 32), f16 d.
 * Values g*32 + l: 2 bits as in Q2_K, minus 4 unless bit g of hmask[l] is set. */
INLINE void blk_q3_k(const uint8_t *src, sink *s, int mode, int64_t o) {
    const uint8_t *sc = src + 96;
    float d = sd_f16_at(src + 108), dl[16];
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4;
        int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * (float)((lo | (hi << 4)) - 32);
    }
    q32 hm = load32(src);
    for (int g = 0; g < 8; g++) {
        q32 q = and32(shr32(load32(src + 32 + (g / 4) * 32), 2 * (g % 4)), bytes32(3));
        q = sub32(q, andnot32(has32(hm, 1 << g), bytes32(4)));
        emit_scale(s, mode, q, 0, dl[2 * g], dl[2 * g + 1], o + 32 * g);
    }
}

/* Q4_K (qh NULL): f16 d, f16 dmin, scales[12] (8 6-bit scales and mins), qs[128]; Q5_K: qh[32]
 * between scales and qs (k45_values); w = (d*sc)*q - dmin*mn. */
INLINE void blk_q45_k(const uint8_t *src, const uint8_t *qs, const uint8_t *qh_bytes, sink *s, int mode, int64_t o) {
#ifdef SD_AVX2
    if (INTEGER(mode)) {
        sb_q45_k(src, qs, qh_bytes, s, mode, o);
        return;
    }
#endif
    float d = sd_f16_at(src), dmin = sd_f16_at(src + 2);
    q32 qh = qh_bytes ? load32(qh_bytes) : bytes32(0);
    uint8_t sc[8], mn[8];
    sd_k4_scales_mins(src + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
        float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
        emit_affine(s, mode, k45_values(qs, qh_bytes ? &qh : NULL, j), 1, ds, dm, ds, dm, o + 32 * j);
    }
}

INLINE void blk_q4_k(const uint8_t *src, sink *s, int mode, int64_t o) {
    blk_q45_k(src, src + 16, NULL, s, mode, o);
}

INLINE void blk_q5_k(const uint8_t *src, sink *s, int mode, int64_t o) {
    blk_q45_k(src, src + 48, src + 16, s, mode, o);
}

/* Q6_K: ql[128], qh[64], int8 scales[16], f16 d. Values h*128 + g*32 + l (h < 2, g < 4):
 * nibble g/2 of ql[h*64 + (g%2)*32 + l], bits 2g..2g+1 of qh[h*32 + l] on top; w = (d*sc)*(q-32). */
INLINE void blk_q6_k(const uint8_t *src, sink *s, int mode, int64_t o) {
#ifdef SD_AVX2
    if (INTEGER(mode)) {
        sb_q6_k(src, s, mode, o);
        return;
    }
#endif
    const int8_t *sc = (const int8_t *)(src + 192);
    float d = sd_f16_at(src + 208);
    for (int h = 0; h < 2; h++) {
        q32 qh = load32(src + 128 + h * 32);
        for (int g = 0; g < 4; g++) {
            int j = h * 8 + g * 2;
            emit_scale(s, mode, q6_values(src, qh, h, g), 0, d * (float)sc[j], d * (float)sc[j + 1],
                       o + h * 128 + g * 32);
        }
    }
}

/* ---- float types: plain loops (any k) ------------------------------------------------------------ */

static void dq_f32(const uint8_t *src, float *dst, int64_t k) { memcpy(dst, src, (size_t)k * 4); }

static void dq_f16(const uint8_t *src, float *dst, int64_t k) {
    int64_t i = 0;
#ifdef SD_AVX2
    for (; i + 8 <= k; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#endif
    for (; i < k; i++) dst[i] = sd_f16_at(src + 2 * i);
}

static void dq_bf16(const uint8_t *src, float *dst, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        uint32_t bits = ((uint32_t)src[2 * i] | ((uint32_t)src[2 * i + 1] << 8)) << 16;
        memcpy(dst + i, &bits, 4);
    }
}

/* ---- dot products ---------------------------------------------------------------------------- */

#ifdef SD_AVX2
static inline float hsum(const __m256 c[2]) {
    __m256 t = _mm256_add_ps(c[0], c[1]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* Zeroes the accumulators of the first `rows` x rows only (a constant: no memset of the whole sink). */
INLINE void sink_init(sink *s, const xrows *x, int rows) {
    s->x = x;
    for (int r = 0; r < rows; r++) {
        s->c[r][0] = s->c[r][1] = _mm256_setzero_ps();
        s->cm[r] = 0.0f;
        s->cmv[r] = _mm256_setzero_ps();
    }
}

/* A walker over a row already in floats (k32 of them, a multiple of 32). */
INLINE void row_floats(const float *a, int64_t k32, sink *s, int mode) {
    for (int64_t o = 0; o < k32; o += 32) {
        __m256 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm256_loadu_ps(a + o + 8 * v);
        emit(s, mode, w, o);
    }
}

/* y[r * ys] = a . x[r] for `rows` (<= MAX_ROWS) x rows of k floats: the whole groups of 32 as the
 * block kernels do them, then the rest one by one. */
static void dot_floats(const float *a, int64_t k, const float *x, int rows, float *y, int64_t ys) {
    sink s;
    xrows xr = {.f = x, .k = k};
    int64_t k32 = k / 32 * 32;
    sink_init(&s, &xr, MAX_ROWS);
    switch (rows) {
    case 1: row_floats(a, k32, &s, 1); break;
    case 2: row_floats(a, k32, &s, 2); break;
    case 3: row_floats(a, k32, &s, 3); break;
    default: row_floats(a, k32, &s, 4); break;
    }
    for (int r = 0; r < rows; r++) {
        float acc = hsum(s.c[r]);
        for (int64_t i = k32; i < k; i++) acc += a[i] * x[r * k + i];
        y[r * ys] = acc;
    }
}

/* x rows (k a multiple of `block`, 32 or QK_K) to integers (xrows): per block of x, scale
 * max|x|/limit (32767 into q, or 127 into q8), values rounded to nearest even; the sums of each 16
 * values. */
void sd_quantize_rows(const float *x, int64_t m, int64_t k, int64_t block, int limit, int16_t *q, int8_t *q8,
                      float *d, int32_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < m * k / block; b++) {
        const float *v = x + block * b;
        __m256 amax = _mm256_setzero_ps();
        for (int64_t j = 0; j < block; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float top = _mm_cvtss_f32(h);
        d[b] = top / (float)limit;
        __m256 inv = _mm256_set1_ps(top > 0.0f ? (float)limit / top : 0.0f);
        for (int64_t i = block * b; i < block * (b + 1); i += 32) {
            __m256i n[4];
            for (int j = 0; j < 4; j++) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), inv));
            /* the packs interleave 128-bit lanes; the permutes put the values back in order */
            __m256i p0 = _mm256_packs_epi32(n[0], n[1]), p1 = _mm256_packs_epi32(n[2], n[3]);
            int sum0 = 0, sum1 = 0;
            if (q8) {
                __m256i b8 = _mm256_packs_epi16(p0, p1);
                b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256((__m256i *)(q8 + i), b8);
                for (int l = 0; l < 16; l++) {
                    sum0 += q8[i + l];
                    sum1 += q8[i + 16 + l];
                }
            } else {
                _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(p0, 0xd8));
                _mm256_storeu_si256((__m256i *)(q + i + 16), _mm256_permute4x64_epi64(p1, 0xd8));
                for (int l = 0; l < 16; l++) {
                    sum0 += q[i + l];
                    sum1 += q[i + 16 + l];
                }
            }
            s[i / 16] = sum0;
            s[i / 16 + 1] = sum1;
        }
    }
}

#else
static void dot_floats(const float *a, int64_t k, const float *x, int rows, float *y, int64_t ys) {
    for (int r = 0; r < rows; r++, x += k) {
        float c[8] = {0}, acc;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8)
            for (int l = 0; l < 8; l++) c[l] += a[i + l] * x[i + l];
        acc = ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
        for (; i < k; i++) acc += a[i] * x[i];
        y[r * ys] = acc;
    }
}
#endif

/* ---- per-type kernels ---------------------------------------------------------------------------
 * dq_<t>: dequantize one row. dot_<t> (AVX2): dot_floats of the dequantized row(s) with 1..4 x rows,
 * straight from the blocks (the same arithmetic without the round trip through memory), or the
 * integer products; with one x row or two, two weight rows go in lockstep so that the core has more
 * independent chains to overlap. */

typedef void (*dq_fn)(const uint8_t *, float *, int64_t);
/* (weight rows, bytes per row, how many (1 or 2), x, x rows, y, y row stride) */
typedef void (*dot_fn)(const uint8_t *, int64_t, int, const xrows *, int, float *, int64_t);

#define WALK(t, BLOCK, BYTES, src, k, s, mode)                                                          \
    for (int64_t o_ = 0, b_ = 0; o_ < (k); o_ += (BLOCK), b_ += (BYTES)) blk_##t((src) + b_, (s), (mode), o_)

#ifdef SD_AVX2
INLINE void sink_store(const sink *s, int mode, float *y, int64_t ys) {
    for (int r = 0; r < ROWS(mode); r++) {
        __m256 none = _mm256_setzero_ps(), minimums[2] = {s->cmv[r], none};
        y[r * ys] = INTEGER(mode) ? hsum(s->c[r]) + s->cm[r] + hsum(minimums) : hsum(s->c[r]);
    }
}

#define WALK2(t, BLOCK, BYTES, src, rb, k, sa, sb, mode)                                                \
    for (int64_t o_ = 0, b_ = 0; o_ < (k); o_ += (BLOCK), b_ += (BYTES)) {                              \
        blk_##t((src) + b_, (sa), (mode), o_);                                                          \
        blk_##t((src) + (rb) + b_, (sb), (mode), o_);                                                   \
    }

/* dot_body_<t> is specialised per constant mode by the switch in dot_<t>. */
#define DOT_KERNEL(t, BLOCK, BYTES)                                                                     \
    INLINE void dot_body_##t(const uint8_t *src, int64_t rb, int nw, const xrows *x, float *y, int64_t ys, \
                             int mode) {                                                                \
        sink a, b;                                                                                      \
        sink_init(&a, x, ROWS(mode));                                                                   \
        if (nw == 2 && ROWS(mode) <= 2) {                                                           \
            sink_init(&b, x, ROWS(mode));                                                               \
            WALK2(t, BLOCK, BYTES, src, rb, x->k, &a, &b, mode);                                        \
            sink_store(&a, mode, y, ys);                                                                \
            sink_store(&b, mode, y + 1, ys);                                                            \
            return;                                                                                     \
        }                                                                                               \
        for (int w = 0; w < nw; w++, src += rb, y++) {                                                  \
            sink_init(&a, x, ROWS(mode));                                                               \
            WALK(t, BLOCK, BYTES, src, x->k, &a, mode);                                                 \
            sink_store(&a, mode, y, ys);                                                                \
        }                                                                                               \
    }                                                                                                   \
    static void dot_##t(const uint8_t *src, int64_t rb, int nw, const xrows *x, int rows, float *y,     \
                        int64_t ys) {                                                                   \
        switch (rows | (x->q ? INT16 : x->q8 ? INT8 : 0)) {                                               \
        case 1: dot_body_##t(src, rb, nw, x, y, ys, 1); break;                                          \
        case 2: dot_body_##t(src, rb, nw, x, y, ys, 2); break;                                          \
        case 3: dot_body_##t(src, rb, nw, x, y, ys, 3); break;                                          \
        case 4: dot_body_##t(src, rb, nw, x, y, ys, 4); break;                                          \
        case INT16 | 1: dot_body_##t(src, rb, nw, x, y, ys, INT16 | 1); break;                            \
        case INT16 | 2: dot_body_##t(src, rb, nw, x, y, ys, INT16 | 2); break;                            \
        case INT16 | 3: dot_body_##t(src, rb, nw, x, y, ys, INT16 | 3); break;                            \
        case INT16 | 4: dot_body_##t(src, rb, nw, x, y, ys, INT16 | 4); break;                            \
        case INT8 | 1: dot_body_##t(src, rb, nw, x, y, ys, INT8 | 1); break;                              \
        case INT8 | 2: dot_body_##t(src, rb, nw, x, y, ys, INT8 | 2); break;                              \
        case INT8 | 3: dot_body_##t(src, rb, nw, x, y, ys, INT8 | 3); break;                              \
        case INT8 | 4: dot_body_##t(src, rb, nw, x, y, ys, INT8 | 4); break;                              \
        }                                                                                               \
    }
#define DOT_OF(t) dot_##t
#else
#define DOT_KERNEL(t, BLOCK, BYTES)
#define DOT_OF(t) NULL
#endif

#define KERNELS(t, BLOCK, BYTES)                                                                        \
    static void dq_##t(const uint8_t *src, float *dst, int64_t k) {                                    \
        sink s = {.dst = dst};                                                                          \
        WALK(t, BLOCK, BYTES, src, k, &s, STORE);                                                       \
    }                                                                                                   \
    DOT_KERNEL(t, BLOCK, BYTES)

KERNELS(q8_0, QK, 34)
KERNELS(q4_0, QK, 18)
KERNELS(q4_1, QK, 20)
KERNELS(q5_0, QK, 22)
KERNELS(q5_1, QK, 24)
KERNELS(q2_k, QK_K, 84)
KERNELS(q3_k, QK_K, 110)
KERNELS(q4_k, QK_K, 144)
KERNELS(q5_k, QK_K, 176)
KERNELS(q6_k, QK_K, 210)

/* ---- type table ------------------------------------------------------------------------------ */

typedef struct {
    int block, bytes;
    dq_fn dq;
    dot_fn dot;  /* NULL: dequantize to a buffer, then dot_floats */
    int x_block; /* integer mode: the x values that share a scale */
} type_info;

static const type_info *info(int type) {
    static const type_info f32 = {1, 4, dq_f32, NULL, 0}, f16 = {1, 2, dq_f16, NULL, 0}, bf16 = {1, 2, dq_bf16, NULL, 0},
                           q8_0 = {QK, 34, dq_q8_0, DOT_OF(q8_0), QK}, q4_0 = {QK, 18, dq_q4_0, DOT_OF(q4_0), QK},
                           q4_1 = {QK, 20, dq_q4_1, DOT_OF(q4_1), QK}, q5_0 = {QK, 22, dq_q5_0, DOT_OF(q5_0), QK},
                           q5_1 = {QK, 24, dq_q5_1, DOT_OF(q5_1), QK}, q2_k = {QK_K, 84, dq_q2_k, DOT_OF(q2_k), QK},
                           q3_k = {QK_K, 110, dq_q3_k, DOT_OF(q3_k), QK},
                           q4_k = {QK_K, 144, dq_q4_k, DOT_OF(q4_k), QK_K},
                           q5_k = {QK_K, 176, dq_q5_k, DOT_OF(q5_k), QK_K},
                           q6_k = {QK_K, 210, dq_q6_k, DOT_OF(q6_k), QK_K};
    switch (type) {
    case T_F32: return &f32;
    case T_F16: return &f16;
    case T_BF16: return &bf16;
    case T_Q8_0: return &q8_0;
    case T_Q4_0: return &q4_0;
    case T_Q4_1: return &q4_1;
    case T_Q5_0: return &q5_0;
    case T_Q5_1: return &q5_1;
    case T_Q2_K: return &q2_k;
    case T_Q3_K: return &q3_k;
    case T_Q4_K: return &q4_k;
    case T_Q5_K: return &q5_k;
    case T_Q6_K: return &q6_k;
    default: return NULL;
    }
}

/* ---- entry points ---------------------------------------------------------------------------- */

/* Weights stream from memory once per call with little compute per byte, and the hardware
 * prefetcher alone keeps too few lines in flight (measured: 1.6-1.9x slower without this). Before
 * working on w[at .. at+bytes), ask for as many bytes PREFETCH_GAP further on (within w[0 .. size)). */
#define PREFETCH_GAP 2048

static inline void prefetch_next(const uint8_t *w, int64_t at, int64_t bytes, int64_t size) {
    int64_t from = at + bytes + PREFETCH_GAP, to = from + bytes < size ? from + bytes : size;
    for (int64_t c = from; c < to; c += 64) __builtin_prefetch(w + c, 0, 3);
}

/* Below this many weight bytes a call runs on the calling thread alone. */
#define PARALLEL_BYTES 32768

int sd_supported(int type) { return info(type) != NULL; }

/* Whether sd_matmul's integer modes exist for `type` here (AVX2 builds, block types). */
int sd_integer(int type) {
#ifdef SD_AVX2
    const type_info *t = info(type);
    return t && t->dot;
#else
    (void)type;
    return 0;
#endif
}

/* How many x values share a scale in sd_matmul's integer mode for `type` (0: no integer mode). */
int sd_x_block(int type) { return sd_integer(type) ? info(type)->x_block : 0; }

/* Bytes of one row of k values, or -1 when the type is unknown or k is not a whole number of blocks. */
int64_t sd_row_bytes(int type, int64_t k) {
    const type_info *t = info(type);
    if (!t || k < 0 || k % t->block) return -1;
    return k / t->block * t->bytes;
}

typedef struct {
    const type_info *t;
    const uint8_t *w;
    int64_t rb, n, k, m;
    const float *x;
    xrows xq; /* integer activations: the rounded rows (q or q8 not NULL) */
    float *y;
    float *bufs; /* per-thread dequantized rows (stride floats each) */
    int64_t stride;
} job;

static void dequantize_row(void *ctx, int64_t r, int thread) {
    const job *j = ctx;
    (void)thread;
    prefetch_next(j->w, r * j->rb, j->rb, j->n * j->rb);
    j->t->dq(j->w + r * j->rb, j->y + r * j->k, j->k);
}

/* rows x k float32, row-major; rows split over threads. */
void sd_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, float *out, int threads) {
    const type_info *t = info(type);
    int64_t rb = sd_row_bytes(type, k);
    if (!t || rb < 0) return;
    job j = {.t = t, .w = w, .rb = rb, .n = rows, .k = k, .y = out};
    if (rows * rb < PARALLEL_BYTES) threads = 1;
    sd_parallel(threads, rows, rows / (8 * (threads > 0 ? threads : 1)) + 1, dequantize_row, &j);
}

typedef struct {
    const type_info *t;
    const uint8_t *w;
    int64_t rb, k;
    const int64_t *rows;
    float *y;
} rows_job;

static void dequantize_id(void *ctx, int64_t i, int thread) {
    const rows_job *j = ctx;
    (void)thread;
    j->t->dq(j->w + j->rows[i] * j->rb, j->y + i * j->k, j->k);
}

/* out[i] = row rows[i] of the n rows of `type` blocks, float32 [count, k] (an embedding lookup, each row as
 * sd_dequantize gives it); -1 (nothing written) for a bad type or a row outside [0, n). */
int sd_dequantize_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *rows, int64_t count, float *out,
                       int threads) {
    const type_info *t = info(type);
    int64_t rb = sd_row_bytes(type, k);
    if (!t || rb < 0) return -1;
    for (int64_t i = 0; i < count; i++)
        if (rows[i] < 0 || rows[i] >= n) return -1;
    rows_job j = {.t = t, .w = w, .rb = rb, .k = k, .rows = rows, .y = out};
    if (count * rb < PARALLEL_BYTES) threads = 1;
    sd_parallel(threads, count, count / (8 * (threads > 0 ? threads : 1)) + 1, dequantize_id, &j);
    return 0;
}

/* Weight rows 2p and 2p+1 straight from their blocks, with the x rows MAX_ROWS at a time. */
static void dot_pair(void *ctx, int64_t p, int thread) {
    const job *j = ctx;
    const uint8_t *w = j->w + 2 * p * j->rb;
    int nw = 2 * p + 1 < j->n ? 2 : 1;
    (void)thread;
    prefetch_next(j->w, 2 * p * j->rb, 2 * j->rb, j->n * j->rb);
    for (int64_t i = 0; i < j->m; i += MAX_ROWS) {
        int rows = j->m - i < MAX_ROWS ? (int)(j->m - i) : MAX_ROWS;
        xrows x = j->xq;
        if (x.q || x.q8) {
            x.q = x.q ? x.q + i * j->k : NULL;
            x.q8 = x.q8 ? x.q8 + i * j->k : NULL;
            x.d += i * (j->k / x.block);
            x.s += i * (j->k / 16);
        } else {
            x = (xrows){.f = j->x + i * j->k, .k = j->k};
        }
        j->t->dot(w, j->rb, nw, &x, rows, j->y + i * j->n + 2 * p, j->n);
    }
}

/* Weight row r dequantized into the thread's buffer (unless float32), dotted with every x row. */
static void dot_buffered(void *ctx, int64_t r, int thread) {
    const job *j = ctx;
    const float *a = (const float *)(j->w + r * j->rb);
    prefetch_next(j->w, r * j->rb, j->rb, j->n * j->rb);
    if (j->bufs) {
        float *buf = j->bufs + j->stride * thread;
        j->t->dq(j->w + r * j->rb, buf, j->k);
        a = buf;
    }
    for (int64_t i = 0; i < j->m; i += MAX_ROWS) {
        int rows = j->m - i < MAX_ROWS ? (int)(j->m - i) : MAX_ROWS;
        dot_floats(a, j->k, j->x + i * j->k, rows, j->y + i * j->n + r, j->n);
    }
}

/* j's x rows rounded for the integer modes (when `activations` asks for one and j's type has them), into
 * memory left in *mem for the caller to free. Returns -1 when out of memory, else 0. */
static int round_x(job *j, int activations, void **mem) {
    *mem = NULL;
#ifdef SD_AVX2
    if (activations == X_FLOAT || !j->t->dot) return 0;
    int64_t values = j->m * j->k, blocks = values / j->t->x_block;
    size_t width = activations == X_INT8 ? 1 : 2;
    /* q first, on a cache line: its 32-byte loads then never straddle two lines */
    size_t bytes = (size_t)values * width + (size_t)(values / 16) * sizeof(int32_t) + (size_t)blocks * sizeof(float);
    void *q = *mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!q) return -1;
    int32_t *s = (int32_t *)((char *)q + (size_t)values * width);
    float *d = (float *)(s + values / 16);
    j->xq = (xrows){.d = d, .s = s, .k = j->k, .block = j->t->x_block};
    if (activations == X_INT8)
        j->xq.q8 = q;
    else
        j->xq.q = q;
    sd_quantize_rows(j->x, j->m, j->k, j->t->x_block, activations == X_INT8 ? 127 : 32767, (int16_t *)j->xq.q,
                  (int8_t *)j->xq.q8, d, s);
#else
    (void)j, (void)activations;
#endif
    return 0;
}

/* Whether j's weight rows are dotted straight from their blocks (dot_pair), not dequantized to a buffer. */
static int direct(const job *j) { return j->xq.q || j->xq.q8 || (j->t->dot && j->m <= MAX_ROWS); }

/* y[m, n] = x[m, k] @ W[n, k]^T, the n weight rows split over threads. With integer activations
 * (when sd_integer) the x rows are rounded first and every weight row is dotted straight from its
 * blocks. Otherwise with m <= MAX_ROWS block rows are dotted straight from their blocks (dot_<t>);
 * above, and for the float types, each row is dequantized once into a per-thread buffer and dotted
 * with the x rows MAX_ROWS at a time. Returns 0, or -1 for a bad type, k or activations, or no memory. */
int sd_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
              int threads, int activations) {
    const type_info *t = info(type);
    int64_t rb = sd_row_bytes(type, k);
    if (!t || rb < 0 || activations < X_FLOAT || activations > X_INT8) return -1;
    if (n <= 0 || m <= 0) return 0;
    if (threads < 1 || n * rb < PARALLEL_BYTES) threads = 1;
    job j = {.t = t, .w = w, .rb = rb, .n = n, .k = k, .m = m, .x = x, .y = y};
    void *mem;
    if (round_x(&j, activations, &mem)) return -1;
    if (!direct(&j) && type != T_F32 && k > 0) {
        j.stride = (k + 15) / 16 * 16; /* floats: whole cache lines per thread */
        j.bufs = mem = aligned_alloc(64, (size_t)(threads * j.stride) * sizeof(float));
        if (!mem) return -1;
    }
    /* Chunks of work handed out as threads free up: a thread that the OS holds back (the machine
     * is shared with the server and everything else) costs one chunk, not its whole share. */
    if (direct(&j))
        sd_parallel(threads, (n + 1) / 2, (n + 1) / 2 / (8 * threads) + 1, dot_pair, &j);
    else
        sd_parallel(threads, n, n / (8 * threads) + 1, dot_buffered, &j);
    free(mem);
    return 0;
}

typedef struct {
    const job *jobs;
    const int64_t *first; /* product i's pairs of weight rows are items first[i] .. first[i + 1] - 1 */
    int64_t count;
} job_list;

static void dot_pair_of_list(void *ctx, int64_t item, int thread) {
    const job_list *l = ctx;
    int64_t i = sd_owner(l->first, l->count, item);
    dot_pair((void *)&l->jobs[i], item - l->first[i], thread);
}

/* The products of `p` (count of them) in one parallel region, each as sd_matmul computes it, bit for bit:
 * a layer's routed experts, whose products are too small to pay for a region each. A product that
 * sd_matmul would dequantize to a buffer runs as an sd_matmul of its own. Returns 0, or -1 as sd_matmul. */
int sd_matmul_many(const sd_product *p, int64_t count, int threads, int activations) {
    if (activations < X_FLOAT || activations > X_INT8) return -1;
    job *jobs = calloc((size_t)count + 1, sizeof(job));
    int64_t *first = calloc((size_t)count + 1, sizeof(int64_t));
    void **mems = calloc((size_t)count + 1, sizeof(void *));
    int status = jobs && first && mems ? 0 : -1;
    int64_t bytes = 0;
    for (int64_t i = 0; i < count && !status; i++) {
        const type_info *t = info(p[i].type);
        int64_t rb = sd_row_bytes(p[i].type, p[i].k), pairs = 0;
        if (!t || rb < 0) {
            status = -1;
            break;
        }
        jobs[i] = (job){.t = t, .w = p[i].w, .rb = rb, .n = p[i].n, .k = p[i].k, .m = p[i].m, .x = p[i].x, .y = p[i].y};
        if (p[i].n > 0 && p[i].m > 0) {
            status = round_x(&jobs[i], activations, &mems[i]);
            if (!status && direct(&jobs[i])) {
                pairs = (p[i].n + 1) / 2;
                bytes += p[i].n * rb;
            } else if (!status) {
                status = sd_matmul(p[i].type, p[i].w, p[i].n, p[i].k, p[i].x, p[i].m, p[i].y, threads, activations);
            }
        }
        first[i + 1] = first[i] + pairs;
    }
    if (!status && first[count] > 0) {
        if (threads < 1 || bytes < PARALLEL_BYTES) threads = 1;
        job_list l = {.jobs = jobs, .first = first, .count = count};
        sd_parallel(threads, first[count], first[count] / (8 * threads) + 1, dot_pair_of_list, &l);
    }
    for (int64_t i = 0; mems && i < count; i++) free(mems[i]);
    free(jobs), free(first), free(mems);
    return status;
}
