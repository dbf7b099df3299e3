/* Q8_0, Q5_0, Q4_K and Q6_K matrices with their rows interleaved in groups of 16 (`R16`), for decode
 * products that run at the memory's speed.
 *
 * Why: a product straight from the file's blocks spends ~13 cycles a block on one row at a time
 * (the scale, the widening, one reduction per row), so a 2-core machine reads the 178 MB head of
 * the demo model at 15 GB/s of the 25 it can. With 16 rows side by side, one load gives 16 rows'
 * weights for the same two x values: the inner loop is a widening load and one multiply-add per
 * 8 rows and 2 values, and the scales of 16 rows come in one load.
 *
 * Layout: the same bytes as the file's rows (34 a block), group g holding rows 16g..16g+15 in
 * `16 * row_bytes` bytes: per block of 32 values, the 16 rows' f16 scales (32 bytes), then for each
 * pair of values p = 0..15 the 16 rows' two int8 quants (32 bytes: row 0's pair, row 1's, ...). A
 * slice of whole groups is a packed matrix of its own, so joined matrices and row ranges stay packed.
 * Q5_0 (22 bytes a block; AVX-512 builds only, where a 32-bit mask register adds the fifth bits): per block
 * the 16 scales (32 bytes), then for each pair p = 0..15 a 32-bit mask whose bit 2r + e is the fifth bit of
 * row r's value 2p + e (64 bytes), then for q = 0..7 the 16 rows' quant bytes q and q + 1 of the file's
 * (32 bytes each: low nibbles values 2q, 2q + 1, high nibbles values 16 + 2q, 17 + 2q).
 * Q4_K (144 bytes a super-block of 256; AVX-512 builds only): per super-block the 16 rows' d (32 bytes),
 * dmin (32), scale words 0, 1 and 2 (64 each), then for each run j = 0..3 of 64 values and pair p = 0..15 the
 * 16 rows' quant bytes 32j + 2p, 32j + 2p + 1 (32 bytes: low nibbles values 64j + 2p + e of sub-block 2j,
 * high nibbles values 64j + 32 + 2p + e of sub-block 2j + 1).
 * Q6_K (210 bytes a super-block; AVX-512 builds only): per super-block the 16 rows' d (32 bytes), their 16 int8
 * scales by sub-block (16 bytes a sub-block), then for each half h and pair p = 0..15 96 bytes: the 16 rows' qh
 * bytes 32h + 2p + e, ql bytes 64h + 2p + e and ql bytes 64h + 32 + 2p + e (the file's bytes, so one chunk holds the
 * values 128h + 32i + 2p + e for i = 0..3).
 *
 * Results are exact per row, as the file layout's products (quant_cpu.c): y[i, j] depends on W[j]
 * and x[i] only. Integer modes: per block (per sub-block for Q4_K and Q6_K), the int32 sum of q * x exactly,
 * then f += float(sum) * (d * dx) in order. Float mode: per block, the products summed in two chains (even and
 * odd values) of FMAs, the chains added, then f += sum * d (Q4_K and Q6_K: rows unpacked, then dotted). */
#include <stdlib.h>
#include <string.h>

#include "f16.h"
#include "packed.h"
#include "pool.h"
#include "quant_cpu.h"
#include "simd.h"

#define GROUP 16
#define QK 32
#define ROWS_AT_ONCE 4 /* x rows a pass over a group */
#define TILE_BLOCK 128 /* x rows a tiles work item takes: their bytes stay in a core's cache across its groups */
#if defined(SD_AVX2) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__BMI2__)
#define SD_WIDE 1 /* 16 rows' int16 pairs in one register, mask registers */
#endif

/* Values and bytes of one row's block (Q4_K: a super-block of 256). */
static int64_t block_values(int type) { return type == T_Q4_K || type == T_Q6_K ? 256 : QK; }
static int64_t block_bytes(int type) {
    return type == T_Q6_K ? 210 : type == T_Q4_K ? 144 : type == T_Q5_0 ? 22 : 34;
}

int sd_packs(int type) {
#ifdef SD_WIDE
    return type == T_Q8_0 || type == T_Q5_0 || type == T_Q4_K || type == T_Q6_K;
#elif defined(SD_AVX2)
    return type == T_Q8_0;
#else
    (void)type;
    return 0;
#endif
}

typedef struct {
    int type;
    const uint8_t *w;
    uint8_t *out;
    int64_t k;
} pack_job;

static void pack_q5_0(const uint8_t *src, int r, uint8_t *o) {
    uint32_t qh = (uint32_t)src[2] | (uint32_t)src[3] << 8 | (uint32_t)src[4] << 16 | (uint32_t)src[5] << 24;
    for (int v = 0; v < QK; v++)
        if (qh >> v & 1) o[32 + 4 * (v / 2) + (2 * r + v % 2) / 8] |= (uint8_t)(1 << ((2 * r + v % 2) % 8));
    for (int q = 0; q < 8; q++) memcpy(o + 96 + 32 * q + 2 * r, src + 6 + 2 * q, 2);
}

static void pack_q4_k(const uint8_t *src, int r, uint8_t *o) {
    memcpy(o + 32 + 2 * r, src + 2, 2);
    for (int w = 0; w < 3; w++) memcpy(o + 64 + 64 * w + 4 * r, src + 4 + 4 * w, 4);
    for (int j = 0; j < 4; j++)
        for (int p = 0; p < 16; p++) memcpy(o + 256 + 32 * (16 * j + p) + 2 * r, src + 16 + 32 * j + 2 * p, 2);
}

/* The file's Q6_K: ql[128], qh[64], 16 int8 scales, d. */
static void pack_q6_k(const uint8_t *src, int r, uint8_t *o) {
    for (int s = 0; s < 16; s++) o[32 + 16 * s + r] = src[192 + s];
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 16; p++) {
            uint8_t *c = o + 288 + 96 * (16 * h + p) + 2 * r;
            memcpy(c, src + 128 + 32 * h + 2 * p, 2);
            memcpy(c + 32, src + 64 * h + 2 * p, 2);
            memcpy(c + 64, src + 64 * h + 32 + 2 * p, 2);
        }
}

static void pack_group(void *ctx, int64_t g, int thread) {
    const pack_job *j = ctx;
    int64_t bb = block_bytes(j->type), nb = j->k / block_values(j->type), rb = nb * bb;
    (void)thread;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = j->out + g * GROUP * rb + b * GROUP * bb;
        if (j->type == T_Q5_0) memset(o + 32, 0, 64);
        for (int r = 0; r < GROUP; r++) {
            const uint8_t *src = j->w + (g * GROUP + r) * rb + b * bb;
            memcpy(o + 2 * r, src + (j->type == T_Q6_K ? 208 : 0), 2); /* d: first in a group's block */
            if (j->type == T_Q6_K)
                pack_q6_k(src, r, o);
            else if (j->type == T_Q5_0)
                pack_q5_0(src, r, o);
            else if (j->type == T_Q4_K)
                pack_q4_k(src, r, o);
            else
                for (int p = 0; p < QK / 2; p++) memcpy(o + 32 + 32 * p + 2 * r, src + 2 + 2 * p, 2);
        }
    }
}

/* n rows of Q8_0, Q5_0, Q4_K or Q6_K blocks (k values each) into `out` (as many bytes), rows interleaved by 16.
 * Returns -1 when the type has no packed layout here, n is not a multiple of 16 or k of a block. */
int sd_pack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    if (!sd_packs(type) || n % GROUP || k % block_values(type) || n < 0 || k < 0) return -1;
    pack_job j = {.type = type, .w = w, .out = out, .k = k};
    sd_parallel(threads, n / GROUP, n / GROUP / (8 * (threads > 0 ? threads : 1)) + 1, pack_group, &j);
    return 0;
}

#ifdef SD_WIDE
/* Row `lane` of a group's Q5_0 block: its 32 values times d into out. */
static void unpack_q5_0(const uint8_t *g, int lane, float d, float *out) {
    uint8_t bytes[16];
    for (int q = 0; q < 8; q++) memcpy(bytes + 2 * q, g + 96 + 32 * q + 2 * lane, 2);
    uint32_t fifth = 0; /* bit v: value v's */
    for (int p = 0; p < 16; p += 2) {
        uint64_t masks;
        memcpy(&masks, g + 32 + 4 * p, 8);
        fifth |= (uint32_t)_pext_u64(masks, 3ull << (2 * lane) | 3ull << (32 + 2 * lane)) << (2 * p);
    }
    __m128i b = _mm_loadu_si128((const __m128i *)bytes), low = _mm_set1_epi8(15);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    v = _mm256_sub_epi8(_mm256_or_si256(v, _mm256_and_si256(_mm256_movm_epi8(fifth), _mm256_set1_epi8(16))),
                        _mm256_set1_epi8(16));
    __m256 dd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++)
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                       _mm_loadl_epi64((const __m128i *)((const int8_t *)&v + 8 * i))))));
}
#endif

/* Row `lane` of a group's Q4_K super-block: (d * scale) * q - dmin * minimum, as gguf-py. */
static void unpack_q4_k(const uint8_t *g, int lane, float d, float *out) {
    float dmin = sd_f16_at(g + 32 + 2 * lane);
    uint8_t words[12], sc[8], mn[8];
    for (int w = 0; w < 3; w++) memcpy(words + 4 * w, g + 64 + 64 * w + 4 * lane, 4);
    sd_k4_scales_mins(words, sc, mn);
    for (int j = 0; j < 4; j++) {
        uint8_t bytes[32]; /* values 64j + v, v < 32, in the low nibbles; 64j + 32 + v in the high ones */
        for (int p = 0; p < 16; p++) memcpy(bytes + 2 * p, g + 256 + 32 * (16 * j + p) + 2 * lane, 2);
        for (int h = 0; h < 2; h++) {
            float dsc = d * (float)sc[2 * j + h], dm = dmin * (float)mn[2 * j + h];
            for (int v = 0; v < 32; v++)
                out[64 * j + 32 * h + v] = dsc * (float)(h ? bytes[v] >> 4 : bytes[v] & 15) - dm;
        }
    }
}

/* Row `lane` of a group's Q6_K super-block: (d * scale) * (q - 32), as gguf-py. */
static void unpack_q6_k(const uint8_t *g, int lane, float d, float *out) {
    for (int h = 0; h < 2; h++) {
        uint8_t hi[32], a[32], b[32]; /* qh, ql 64h.., ql 64h + 32.. of the file's row */
        for (int p = 0; p < 16; p++) {
            const uint8_t *c = g + 288 + 96 * (16 * h + p) + 2 * lane;
            memcpy(hi + 2 * p, c, 2), memcpy(a + 2 * p, c + 32, 2), memcpy(b + 2 * p, c + 64, 2);
        }
        for (int i = 0; i < 4; i++) {
            const uint8_t *low = i % 2 ? b : a;
            for (int l0 = 0; l0 < 32; l0 += 16) {
                int v = 128 * h + 32 * i + l0;
                float ds = d * (float)(int8_t)g[32 + 16 * (v / 16) + lane];
                for (int l = l0; l < l0 + 16; l++)
                    out[v + l - l0] = ds * (float)(((i < 2 ? low[l] & 15 : low[l] >> 4) | (hi[l] >> 2 * i & 3) << 4) - 32);
            }
        }
    }
}

static void unpack_q8_0(const uint8_t *g, int lane, float d, float *out) {
    int8_t q[QK];
    for (int p = 0; p < QK / 2; p++) memcpy(q + 2 * p, g + 32 + 32 * p + 2 * lane, 2);
    for (int v = 0; v < QK; v++) out[v] = d * (float)q[v];
}

/* Row `lane` of a group's block (a super-block for the K types) at g, dequantized as gguf-py does. */
static void unpack_block(int type, const uint8_t *g, int lane, float *out) {
    float d = sd_f16_at(g + 2 * lane);
    switch (type) {
    case T_Q4_K: unpack_q4_k(g, lane, d, out); break;
    case T_Q6_K: unpack_q6_k(g, lane, d, out); break;
#ifdef SD_WIDE
    case T_Q5_0: unpack_q5_0(g, lane, d, out); break;
#endif
    default: unpack_q8_0(g, lane, d, out);
    }
}

/* Row r (any r < n) of a packed matrix. */
static void unpack_row(int type, const uint8_t *w, int64_t k, int64_t r, float *out) {
    int64_t bb = block_bytes(type), bv = block_values(type), nb = k / bv;
    const uint8_t *g = w + r / GROUP * GROUP * nb * bb;
    for (int64_t b = 0; b < nb; b++, g += GROUP * bb) unpack_block(type, g, (int)(r % GROUP), out + b * bv);
}

typedef struct {
    int type;
    const uint8_t *w;
    int64_t k;
    const int64_t *rows;
    float *out;
} unpack_job;

static void unpack_item(void *ctx, int64_t i, int thread) {
    const unpack_job *j = ctx;
    (void)thread;
    unpack_row(j->type, j->w, j->k, j->rows[i], j->out + i * j->k);
}

/* out[i] = row rows[i] of the packed matrix of n rows of `type`, float32 [count, k]; -1 (nothing written) for a
 * row outside [0, n). */
int sd_unpack_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *rows, int64_t count, float *out,
                   int threads) {
    for (int64_t i = 0; i < count; i++)
        if (rows[i] < 0 || rows[i] >= n) return -1;
    unpack_job j = {.type = type, .w = w, .k = k, .rows = rows, .out = out};
    if (count * k < 32768) threads = 1;
    sd_parallel(threads, count, count / (8 * (threads > 0 ? threads : 1)) + 1, unpack_item, &j);
    return 0;
}

#ifdef SD_AVX2
/* 8 rows' f16 scales of a group's block (rows 0-7 at h = 0, 8-15 at h = 1). */
INLINE __m256 scales8(const uint8_t *block, int h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * h))); }

/* acc + the int16 pair products of w and x summed per 32-bit lane (one VNNI instruction where there is one). */
INLINE __m256i dot_pairs(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

INLINE int32_t x_pair(const int16_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

#ifdef SD_WIDE
/* Pair p (values 2p, 2p + 1) of a group's block of `type`: 32 int16, lane 2r + e row r's value 2p + e. */
INLINE __m512i pair16(int type, const uint8_t *blk, int p) {
    if (type != T_Q5_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * p)));
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 96 + 32 * (p % 8))));
    __m512i low = p < 8 ? _mm512_and_si512(bytes, _mm512_set1_epi16(15)) : _mm512_srli_epi16(bytes, 4);
    uint32_t fifth;
    memcpy(&fifth, blk + 32 + 4 * p, 4);
    return _mm512_mask_sub_epi16(low, (__mmask32)~fifth, low, _mm512_set1_epi16(16)); /* (low | fifth << 4) - 16 */
}
#endif

/* Integer modes: x rows as int16 values q [rows, k] with a scale per 32, d [rows, k / 32]. */
#ifdef SD_WIDE
/* Q4_K: a sub-block's int32 sum of q * x exactly (one int32 can't hold a super-block's at int16 x), then per
 * row f += float(sum) * (d * scale * dx) and f -= (dmin * minimum) * (dx * float(sum of x)), sub-blocks in order. */
INLINE void group_q4_k(const uint8_t *gw, int64_t gs, int groups, int64_t nb, const int16_t *q, const float *dx,
                       const int32_t *xs, int64_t k, int rows, float *y, int64_t ys) {
    const __m512i nibble = _mm512_set1_epi16(15);
    __m512 f[8]; /* row r, group g at r * groups + g; rows * groups <= 8 */
    for (int i = 0; i < rows * groups; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gw += GROUP * block_bytes(T_Q4_K)) {
        __m512i words[8][4];
        __m512 d[8], dmin[8];
        for (int g = 0; g < groups; g++) {
            const uint8_t *blk = gw + g * gs;
            d[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            dmin[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
            sd_q4_k_words(blk, words[g]);
        }
        for (int j = 0; j < 4; j++) {
            __m512i a[2][8];
            for (int i = 0; i < rows * groups; i++) a[0][i] = a[1][i] = _mm512_setzero_si512();
            for (int p = 0; p < 16; p++) {
                __m512i xl[ROWS_AT_ONCE], xh[ROWS_AT_ONCE];
                for (int r = 0; r < rows; r++) {
                    const int16_t *xr = q + r * k + b * 256 + 64 * j + 2 * p;
                    xl[r] = _mm512_set1_epi32(x_pair(xr));
                    xh[r] = _mm512_set1_epi32(x_pair(xr + 32));
                }
                for (int g = 0; g < groups; g++) {
                    __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(gw + g * gs + 256 + 32 * (16 * j + p))));
                    __m512i lo = _mm512_and_si512(raw, nibble), hi = _mm512_srli_epi16(raw, 4);
                    for (int r = 0; r < rows; r++) {
                        a[0][r * groups + g] = _mm512_dpwssd_epi32(a[0][r * groups + g], lo, xl[r]);
                        a[1][r * groups + g] = _mm512_dpwssd_epi32(a[1][r * groups + g], hi, xh[r]);
                    }
                }
            }
            for (int h = 0; h < 2; h++) {
                int sb = 2 * j + h;
                for (int g = 0; g < groups; g++) {
                    __m512 dsc = _mm512_mul_ps(d[g], sd_q4_k_field(words[g], 0, sb));
                    __m512 dmn = _mm512_mul_ps(dmin[g], sd_q4_k_field(words[g], 2, sb));
                    for (int r = 0; r < rows; r++) {
                        int64_t at = r * (k / QK) + b * 8 + sb;
                        float dxs = dx[at], xsum = (float)(xs[2 * at] + xs[2 * at + 1]);
                        int i = r * groups + g;
                        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[h][i]), _mm512_mul_ps(dsc, _mm512_set1_ps(dxs)), f[i]);
                        f[i] = _mm512_fnmadd_ps(dmn, _mm512_set1_ps(dxs * xsum), f[i]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) _mm512_storeu_ps(y + r * ys + g * GROUP, f[r * groups + g]);
}

/* Q6_K: a sub-block's (16 values) int32 sum of (q - 32) * x exactly, then per row f += float(sum) * (d * scale * dx),
 * each half's sub-blocks in the order 2i + ph (i the run of 32 values, ph its half). */
INLINE void group_q6_k(const uint8_t *gw, int64_t gs, int groups, int64_t nb, const int16_t *q, const float *dx,
                       int64_t k, int rows, float *y, int64_t ys) {
    const __m512i nibble = _mm512_set1_epi16(15), bits = _mm512_set1_epi16(3), off = _mm512_set1_epi16(32);
    __m512 f[4]; /* row r, group g at r * groups + g; rows * groups <= 4 */
    for (int i = 0; i < rows * groups; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gw += GROUP * block_bytes(T_Q6_K)) {
        for (int h = 0; h < 2; h++)
            for (int ph = 0; ph < 2; ph++) {
                __m512i a[4][4]; /* run i; row r, group g at r * groups + g */
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < rows * groups; c++) a[i][c] = _mm512_setzero_si512();
                for (int p = 8 * ph; p < 8 * ph + 8; p++) {
                    __m512i x[4][ROWS_AT_ONCE];
                    for (int i = 0; i < 4; i++)
                        for (int r = 0; r < rows; r++)
                            x[i][r] = _mm512_set1_epi32(x_pair(q + r * k + b * 256 + 128 * h + 32 * i + 2 * p));
                    for (int g = 0; g < groups; g++) {
                        const uint8_t *c = gw + g * gs + 288 + 96 * (16 * h + p);
                        __m512i hi = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)c));
                        __m512i la = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c + 32)));
                        __m512i lb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c + 64)));
                        __m512i w[4] = {_mm512_and_si512(la, nibble), _mm512_and_si512(lb, nibble), _mm512_srli_epi16(la, 4),
                                        _mm512_srli_epi16(lb, 4)};
                        for (int i = 0; i < 4; i++) {
                            __m512i top = _mm512_and_si512(_mm512_srli_epi16(hi, 2 * i), bits);
                            w[i] = _mm512_sub_epi16(_mm512_or_si512(w[i], _mm512_slli_epi16(top, 4)), off);
                            for (int r = 0; r < rows; r++)
                                a[i][r * groups + g] = _mm512_dpwssd_epi32(a[i][r * groups + g], w[i], x[i][r]);
                        }
                    }
                }
                for (int g = 0; g < groups; g++) {
                    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gw + g * gs)));
                    for (int i = 0; i < 4; i++) {
                        int sb = 8 * h + 2 * i + ph;
                        __m512 ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                         _mm_loadu_si128((const __m128i *)(gw + g * gs + 32 + 16 * sb)))));
                        for (int r = 0; r < rows; r++) {
                            int c = r * groups + g;
                            f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][c]),
                                                   _mm512_mul_ps(ds, _mm512_set1_ps(dx[r * (k / QK) + b * 8 + 4 * h + i])), f[c]);
                        }
                    }
                }
            }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) _mm512_storeu_ps(y + r * ys + g * GROUP, f[r * groups + g]);
}

/* `groups` groups at once (gs bytes apart), a block of each in turn, rows * groups <= STREAMS:
 * as many streams from memory. A core reading one group at a time keeps too few reads in flight: with 16
 * the demo's head takes ~0.8x the time. A row's arithmetic does not depend on the groups beside it (the same
 * bits as one group at a time, and as the AVX2 path's). */
#define STREAMS 16
INLINE void groups_int(int type, const uint8_t *gw, int64_t gs, int groups, int64_t nb, const int16_t *q,
                       const float *d, int64_t k, int rows, float *y, int64_t ys) {
    __m512 f[STREAMS]; /* row r, group g at r * groups + g */
    for (int i = 0; i < rows * groups; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gw += GROUP * block_bytes(type)) {
        __m512i a[STREAMS];
        for (int i = 0; i < rows * groups; i++) a[i] = _mm512_setzero_si512();
        for (int p = 0; p < QK / 2; p++) {
            __m512i x[ROWS_AT_ONCE];
            for (int r = 0; r < rows; r++) x[r] = _mm512_set1_epi32(x_pair(q + r * k + b * QK + 2 * p));
            for (int g = 0; g < groups; g++) {
                __m512i w = pair16(type, gw + g * gs, p);
                for (int r = 0; r < rows; r++) a[r * groups + g] = _mm512_dpwssd_epi32(a[r * groups + g], w, x[r]);
            }
        }
        for (int g = 0; g < groups; g++) {
            __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gw + g * gs)));
            for (int r = 0; r < rows; r++)
                f[r * groups + g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r * groups + g]),
                                                    _mm512_mul_ps(scales, _mm512_set1_ps(d[r * (k / QK) + b])),
                                                    f[r * groups + g]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) _mm512_storeu_ps(y + r * ys + g * GROUP, f[r * groups + g]);
}

/* One group (16 rows in one register: a pair's 32 quants widened in one instruction). */
INLINE void group_int(int type, const uint8_t *gw, int64_t nb, const int16_t *q, const float *d, int64_t k, int rows,
                      float *y, int64_t ys) {
    groups_int(type, gw, 0, 1, nb, q, d, k, rows, y, ys);
}

/* Groups a work item takes for m x rows in an integer mode (rows * groups within the type's kernel's
 * accumulators in every pass: STREAMS for groups_int, 8 for group_q4_k, 4 for group_q6_k). */
static int64_t set_size(int type, int64_t m) {
    if (block_values(type) == 256) return m == 1 ? 4 : type == T_Q4_K ? 2 : 1;
    return m == 1 ? 16 : m == 2 ? 8 : 4;
}

/* groups_int with its type, rows and groups constant (a pass of `rows` x rows over a whole set). */
static void groups_pass(int type, const uint8_t *gw, int64_t gs, int set, int64_t nb, const int16_t *q, const float *d,
                        int64_t k, int rows, float *y, int64_t ys) {
#define PASS(T, R, S) case T * 1024 + R * 32 + S: groups_int(T, gw, gs, S, nb, q, d, k, R, y, ys); break;
#define PASSES(T) PASS(T, 1, 16) PASS(T, 1, 8) PASS(T, 1, 4) PASS(T, 2, 8) PASS(T, 2, 4) PASS(T, 3, 4) PASS(T, 4, 4)
    switch (type * 1024 + rows * 32 + set) {
    PASSES(T_Q8_0) PASSES(T_Q5_0)
    default: /* not a set sd_matmul_packed makes */
        for (int g = 0; g < set; g++) group_int(type, gw + g * gs, nb, q, d, k, rows, y + g * GROUP, ys);
    }
#undef PASSES
#undef PASS
}
#else
/* Q8_0 only (the one type that packs on AVX2 builds). */
INLINE void group_int(int type, const uint8_t *gw, int64_t nb, const int16_t *q, const float *d, int64_t k, int rows,
                      float *y, int64_t ys) {
    __m256 f[ROWS_AT_ONCE][2];
    (void)type;
    for (int r = 0; r < rows; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gw += GROUP * block_bytes(T_Q8_0)) {
        __m256i a[ROWS_AT_ONCE][2];
        for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int p = 0; p < QK / 2; p++) {
            const uint8_t *pair = gw + 32 + 32 * p;
            __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)pair));
            __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(pair + 16)));
            for (int r = 0; r < rows; r++) {
                __m256i xp = _mm256_set1_epi32(x_pair(q + r * k + b * QK + 2 * p));
                a[r][0] = dot_pairs(a[r][0], w0, xp);
                a[r][1] = dot_pairs(a[r][1], w1, xp);
            }
        }
        for (int r = 0; r < rows; r++) {
            __m256 dx = _mm256_set1_ps(d[r * (k / QK) + b]);
            for (int h = 0; h < 2; h++)
                f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), _mm256_mul_ps(scales8(gw, h), dx), f[r][h]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * ys, f[r][0]);
        _mm256_storeu_ps(y + r * ys + 8, f[r][1]);
    }
}
#endif

/* Float mode: while a block is summed, a lane holds one row's products of even or of odd values. */
#if defined(__AVX512F__)
/* Half h (rows 8h..8h + 7) of pair p of a group's block as floats, lanes (row, parity). */
INLINE __m512 pair_floats(int type, const uint8_t *blk, int p, int h) {
#ifdef SD_WIDE
    if (type == T_Q5_0) {
        __m512i w = pair16(type, blk, p);
        return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(h ? _mm512_extracti64x4_epi64(w, 1) : _mm512_castsi512_si256(w)));
    }
#endif
    (void)type;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 32 * p + 16 * h))));
}

INLINE void group_float(int type, const uint8_t *gw, int64_t nb, const float *x, int64_t k, int rows, float *y,
                        int64_t ys) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512 f[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gw += GROUP * block_bytes(type)) {
        __m512 a[ROWS_AT_ONCE][2]; /* rows 0-7 and 8-15, lanes (row, parity) */
        for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int p = 0; p < QK / 2; p++) {
            for (int h = 0; h < 2; h++) {
                __m512 w = pair_floats(type, gw, p, h);
                for (int r = 0; r < rows; r++) {
                    double xp;
                    memcpy(&xp, x + r * k + b * QK + 2 * p, 8);
                    a[r][h] = _mm512_fmadd_ps(w, _mm512_castpd_ps(_mm512_set1_pd(xp)), a[r][h]);
                }
            }
        }
        __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gw));
        for (int r = 0; r < rows; r++) {
            /* even + odd in each even lane, then the even lanes of both halves in row order */
            __m512 s0 = _mm512_add_ps(a[r][0], _mm512_permute_ps(a[r][0], 0xB1));
            __m512 s1 = _mm512_add_ps(a[r][1], _mm512_permute_ps(a[r][1], 0xB1));
            f[r] = _mm512_fmadd_ps(_mm512_permutex2var_ps(s0, evens, s1), scales, f[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * ys, f[r]);
}
#else
/* Q8_0 only (the one type that packs on AVX2 builds). */
INLINE void group_float(int type, const uint8_t *gw, int64_t nb, const float *x, int64_t k, int rows, float *y,
                        int64_t ys) {
    __m256 f[ROWS_AT_ONCE][2];
    (void)type;
    for (int r = 0; r < rows; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gw += GROUP * block_bytes(T_Q8_0)) {
        __m256 a[ROWS_AT_ONCE][4]; /* rows 4h..4h+3, lanes (row, parity) */
        for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
        for (int p = 0; p < QK / 2; p++) {
            const uint8_t *pair = gw + 32 + 32 * p;
            for (int h = 0; h < 4; h++) {
                __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(pair + 8 * h))));
                for (int r = 0; r < rows; r++) {
                    __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(x + r * k + b * QK + 2 * p)));
                    a[r][h] = _mm256_fmadd_ps(wf, xp, a[r][h]);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            /* even + odd per row; hadd leaves rows [0 1 4 5 | 2 3 6 7] of each half, the permute orders them */
            for (int h = 0; h < 2; h++) {
                __m256 s = _mm256_hadd_ps(a[r][2 * h], a[r][2 * h + 1]);
                s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xd8));
                f[r][h] = _mm256_fmadd_ps(s, scales8(gw, h), f[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * ys, f[r][0]);
        _mm256_storeu_ps(y + r * ys + 8, f[r][1]);
    }
}
#endif

#ifndef SD_WIDE
static int64_t set_size(int type, int64_t m) { return (void)type, (void)m, 1; }
#endif

typedef struct {
    int type;
    const uint8_t *w;
    int64_t n, k, m, set; /* set: groups a work item takes */
    const float *x;
    const int16_t *q; /* integer modes: x rounded */
    const float *d;
    const int32_t *s; /* the sum of each 16 rounded values */
    const int8_t *hi; /* on AMX tiles: q split into bytes (sd_split_rows), else NULL */
    const uint8_t *lo;
    const float *xmin; /* Q4_K on tiles: each x block's scale times its sum */
    float *y;
} product;

#ifdef SD_WIDE
/* A Q4_K or Q6_K group in float mode: each super-block's 16 rows unpacked as gguf-py does, each x row dotted with
 * them (one chain of FMAs a row, 16 values a step), the super-blocks' dots added in order. */
static void group_k_float(const product *j, int64_t g) {
    float tile[GROUP][256];
    int64_t bb = block_bytes(j->type), nb = j->k / 256;
    const uint8_t *gw = j->w + g * GROUP * nb * bb;
    for (int64_t i = 0; i < j->m; i++) memset(j->y + i * j->n + g * GROUP, 0, GROUP * sizeof(float));
    for (int64_t b = 0; b < nb; b++, gw += GROUP * bb) {
        for (int r = 0; r < GROUP; r++) unpack_block(j->type, gw, r, tile[r]);
        for (int64_t i = 0; i < j->m; i++) {
            const float *x = j->x + i * j->k + b * 256;
            for (int r = 0; r < GROUP; r++) {
                __m512 acc = _mm512_setzero_ps();
                for (int v = 0; v < 256; v += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(tile[r] + v), _mm512_loadu_ps(x + v), acc);
                j->y[i * j->n + g * GROUP + r] += _mm512_reduce_add_ps(acc);
            }
        }
    }
}

/* x rows i..i + rows - 1 against Q4_K or Q6_K groups g0..g0 + groups - 1 (integer modes), their type's kernel. */
static void group_k(const product *j, int64_t g0, int groups, int64_t i, int rows) {
    const int16_t *q = j->q + i * j->k;
    const float *d = j->d + i * (j->k / QK);
    const int32_t *s = j->s + i * (j->k / 16);
    float *y = j->y + i * j->n + g0 * GROUP;
    int64_t nb = j->k / 256, gs = GROUP * nb * block_bytes(j->type);
    const uint8_t *gw = j->w + g0 * gs;
#define K_PASS(R, G) case R * 8 + G:                                                                          \
    if (j->type == T_Q4_K) group_q4_k(gw, gs, G, nb, q, d, s, j->k, R, y, j->n);                          \
    else if (R * G <= 4) group_q6_k(gw, gs, G, nb, q, d, j->k, R, y, j->n);                              \
    else for (int g = 0; g < G; g++) group_k(j, g0 + g, 1, i, rows);                                      \
    break;
    switch (rows * 8 + groups) {
    K_PASS(1, 1) K_PASS(2, 1) K_PASS(3, 1) K_PASS(4, 1) K_PASS(1, 4) K_PASS(2, 2) K_PASS(3, 2) K_PASS(4, 2)
    default: /* not a pass sd_matmul_packed makes */
        for (int g = 0; g < groups; g++) group_k(j, g0 + g, 1, i, rows);
    }
#undef K_PASS
}

static void group_k_of(const product *j, int64_t g) {
    if (!j->q) {
        group_k_float(j, g);
        return;
    }
    for (int64_t i = 0; i < j->m; i += ROWS_AT_ONCE)
        group_k(j, g, 1, i, j->m - i < ROWS_AT_ONCE ? (int)(j->m - i) : ROWS_AT_ONCE);
}

/* x rows i..i + rows - 1 against the whole set of groups from g0 (integer modes), the type's kernel. */
static void pass_int(const product *j, int64_t g0, int64_t i, int rows) {
    if (block_values(j->type) == 256) {
        group_k(j, g0, (int)j->set, i, rows);
        return;
    }
    int64_t nb = j->k / QK, gs = GROUP * nb * block_bytes(j->type);
    groups_pass(j->type, j->w + g0 * gs, gs, (int)j->set, nb, j->q + i * j->k, j->d + i * nb, j->k, rows,
                j->y + i * j->n + g0 * GROUP, j->n);
}
#endif

/* Every x row against group g, ROWS_AT_ONCE x rows a pass (a constant `rows` and `type` per call below). */
INLINE void group_of(const product *j, int64_t g, int type) {
    int64_t nb = j->k / QK;
    const uint8_t *gw = j->w + g * GROUP * nb * block_bytes(type);
    for (int64_t i = 0; i < j->m; i += ROWS_AT_ONCE) {
        int rows = j->m - i < ROWS_AT_ONCE ? (int)(j->m - i) : ROWS_AT_ONCE;
        float *y = j->y + i * j->n + g * GROUP;
        if (j->q) {
            const int16_t *q = j->q + i * j->k;
            const float *d = j->d + i * nb;
            switch (rows) {
            case 1: group_int(type, gw, nb, q, d, j->k, 1, y, j->n); break;
            case 2: group_int(type, gw, nb, q, d, j->k, 2, y, j->n); break;
            case 3: group_int(type, gw, nb, q, d, j->k, 3, y, j->n); break;
            default: group_int(type, gw, nb, q, d, j->k, 4, y, j->n); break;
            }
        } else {
            const float *x = j->x + i * j->k;
            switch (rows) {
            case 1: group_float(type, gw, nb, x, j->k, 1, y, j->n); break;
            case 2: group_float(type, gw, nb, x, j->k, 2, y, j->n); break;
            case 3: group_float(type, gw, nb, x, j->k, 3, y, j->n); break;
            default: group_float(type, gw, nb, x, j->k, 4, y, j->n); break;
            }
        }
    }
}

static void product_group(const product *j, int64_t g) {
#ifdef SD_WIDE
    if (j->type == T_Q4_K || j->type == T_Q6_K) {
        group_k_of(j, g);
        return;
    }
#endif
    if (j->type == T_Q5_0)
        group_of(j, g, T_Q5_0);
    else
        group_of(j, g, T_Q8_0);
}

/* Work item s: groups s * set .. (s + 1) * set - 1 (fewer at the end), a whole set at once in the integer modes. */
static void product_set(void *ctx, int64_t s, int thread) {
    const product *j = ctx;
    int64_t g0 = s * j->set, g1 = g0 + j->set < j->n / GROUP ? g0 + j->set : j->n / GROUP;
    (void)thread;
    if (j->hi) { /* item s: group s % groups against row block s / groups */
        int64_t groups = j->n / GROUP, g = s % groups, i = s / groups * TILE_BLOCK, k = j->k;
        int64_t rows = j->m - i < TILE_BLOCK ? j->m - i : TILE_BLOCK;
        product part = *j; /* the block's rows alone */
        part.m = rows, part.q += i * k, part.d += i * (k / QK), part.s += i * (k / 16), part.y += i * j->n;
        if (sd_tiles_product(j->type, j->w + g * GROUP * (k / block_values(j->type)) * block_bytes(j->type), k, j->hi + i * k,
                             j->lo + i * k, part.d, j->xmin ? j->xmin + i * (k / QK) : NULL, rows, part.y + g * GROUP, j->n))
            product_group(&part, g); /* no memory for the tiles: the int16 kernel, the same bits */
        return;
    }
#ifdef SD_WIDE
    if (j->q && j->set > 1 && g1 - g0 == j->set) {
        for (int64_t i = 0; i < j->m; i += ROWS_AT_ONCE)
            pass_int(j, g0, i, j->m - i < ROWS_AT_ONCE ? (int)(j->m - i) : ROWS_AT_ONCE);
        return;
    }
#endif
    for (int64_t g = g0; g < g1; g++) product_group(j, g);
}
#endif

#ifdef SD_AVX2
/* Products of at least this many x rows run on AMX tiles where there are some: where they beat the int16 kernel on
 * one core (Q8_0 768 x 2048: 12 rows 0.154-0.194 ms against 0.162-0.167; Q4_K 768 x 2048 at 9 rows 0.18-0.19
 * against 0.20-0.22, at 8 0.18-0.19 against 0.16-0.18; Q6_K 2048 x 768 at 9 rows 0.24-0.26 against 0.28-0.32;
 * fewer than 16 rows take tiles of as many). */
static int64_t tile_rows_from(int type) { return type == T_Q8_0 ? 12 : type == T_Q5_0 ? 8 : 9; }

/* x rounded for j's integer modes (into *mem, for the caller to free; on AMX tiles also split into bytes: j->hi
 * set). Returns 0, or -1 when out of memory. */
static int round_x(product *j, int activations, void **mem) {
    *mem = NULL;
    if (activations == X_FLOAT) return 0;
    size_t values = (size_t)(j->m * j->k);
    int tiles = j->m >= tile_rows_from(j->type) && sd_tiles();
    int mins = tiles && j->type == T_Q4_K; /* Q4_K's minimum terms take each x block's scale times its sum */
    *mem = aligned_alloc(64, (values * 2 + values / 16 * 4 + values / QK * 4 + (tiles ? 2 * values : 0) +
                              (mins ? values / QK * 4 : 0) + 63) / 64 * 64);
    if (!*mem) return -1;
    int16_t *q = *mem;
    int32_t *sums = (int32_t *)(q + values);
    float *d = (float *)(sums + values / 16);
    sd_quantize_rows(j->x, j->m, j->k, QK, activations == X_INT8 ? 127 : 32767, q, NULL, d, sums);
    j->q = q, j->d = d, j->s = sums;
    if (tiles) {
        int8_t *hi = (int8_t *)(d + values / QK);
        uint8_t *lo = (uint8_t *)hi + values;
        float *xmin = mins ? (float *)(lo + values) : NULL;
        sd_split_rows(q, j->m, j->k, hi, lo);
        for (size_t b = 0; mins && b < values / QK; b++) xmin[b] = d[b] * (float)(sums[2 * b] + sums[2 * b + 1]);
        j->hi = hi, j->lo = lo, j->xmin = xmin;
    }
    return 0;
}

/* The groups a work item of j takes (j->set), once x is rounded; returns the work items. */
static int64_t work_items(product *j, int threads, int activations) {
    if (j->hi) { /* tiles: a group a row block */
        j->set = 1;
        return j->n / GROUP * ((j->m + TILE_BLOCK - 1) / TILE_BLOCK);
    }
    j->set = activations == X_FLOAT ? 1 : set_size(j->type, j->m);
    int64_t sets = (j->n / GROUP + j->set - 1) / j->set;
    for (; j->set > 4 && sets < 4 * threads; sets = (j->n / GROUP + j->set - 1) / j->set) j->set /= 2; /* work for all */
    return sets;
}

/* j ready for product_set: x rounded (round_x) and its work items. Returns the work items, or -1 when out of
 * memory. */
static int64_t prepare(product *j, int threads, int activations, void **mem) {
    return round_x(j, activations, mem) ? -1 : work_items(j, threads, activations);
}
#endif

static int packable(int type, int64_t n, int64_t k, int activations) {
    return sd_packs(type) && n % GROUP == 0 && k % block_values(type) == 0 && activations >= X_FLOAT &&
           activations <= X_INT8;
}

/* y[m, n] = x[m, k] @ W[n, k]^T with W packed (sd_pack), the groups split over threads; activations as
 * sd_matmul's (int8: x rounded to +-127, then the same integer products). Returns 0, or -1 for a
 * type without a packed layout, a bad shape or activations, or no memory. */
int sd_matmul_packed(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                     int threads, int activations) {
    if (!packable(type, n, k, activations)) return -1;
    if (n <= 0 || m <= 0) return 0;
#ifdef SD_AVX2
    product j = {.type = type, .w = w, .n = n, .k = k, .m = m, .x = x, .y = y};
    void *mem;
    if (threads < 1 || n * k < SD_SPREAD_FROM) threads = 1;
    int64_t sets = prepare(&j, threads, activations, &mem);
    if (sets < 0) return -1;
    sd_parallel(threads, sets, sets / (8 * threads) + 1, product_set, &j);
    free(mem);
    return 0;
#else
    (void)w, (void)x, (void)y, (void)threads;
    return -1;
#endif
}

#ifdef SD_AVX2
typedef struct {
    const product *jobs;
    const int64_t *first; /* product i's work items are first[i] .. first[i + 1] - 1 */
    int64_t count;
} product_list;

static void product_set_of_list(void *ctx, int64_t item, int thread) {
    const product_list *l = ctx;
    int64_t i = sd_owner(l->first, l->count, item);
    product_set((void *)&l->jobs[i], item - l->first[i], thread);
}

typedef struct {
    product *jobs;
    const int64_t *twin; /* the earlier product whose rounded x job i takes, or -1 */
    void **mems;
    int activations;
    _Atomic int bad; /* out of memory */
} rounding_list;

static void round_one(void *ctx, int64_t i, int thread) {
    (void)thread;
    rounding_list *l = ctx;
    if (l->twin[i] < 0 && l->jobs[i].n > 0 && l->jobs[i].m > 0 && round_x(&l->jobs[i], l->activations, &l->mems[i]))
        l->bad = 1;
}

/* twin[i]: the first earlier product of the same type over the same x rows (a layer's gate and up), whose rounding
 * product i takes instead of its own; -1 for none. Returns the x values the others round. */
static int64_t twins(const product *jobs, int64_t count, int64_t *twin) {
    int64_t values = 0;
    for (int64_t i = 0; i < count; i++) {
        const product *a = &jobs[i];
        twin[i] = -1;
        if (a->m <= 0 || a->n <= 0) continue; /* nothing to round */
        for (int64_t t = 0; t < i && twin[i] < 0; t++) { /* the first such rounds its own */
            const product *b = &jobs[t];
            if (b->x == a->x && b->m == a->m && b->k == a->k && b->type == a->type && b->n > 0) twin[i] = t;
        }
        if (twin[i] < 0) values += a->m * a->k;
    }
    return values;
}
#endif

/* The packed products of `p` (count of them) in one parallel region, each as sd_matmul_packed computes it, bit
 * for bit: a layer's routed experts (moe_cpu.c), whose products are too small to pay for a region each. Products
 * over the same x rows (a layer's gates and ups) round them once; a prompt chunk's rounding runs over the threads
 * first. Returns 0, or -1 as sd_matmul_packed. */
int sd_matmul_packed_many(const sd_product *p, int64_t count, int threads, int activations) {
    for (int64_t i = 0; i < count; i++)
        if (!packable(p[i].type, p[i].n, p[i].k, activations)) return -1;
#ifdef SD_AVX2
    product *jobs = calloc((size_t)count + 1, sizeof(product));
    int64_t *first = calloc((size_t)count + 1, sizeof(int64_t)), *twin = calloc((size_t)count + 1, sizeof(int64_t));
    void **mems = calloc((size_t)count + 1, sizeof(void *));
    int status = jobs && first && twin && mems ? 0 : -1;
    int64_t values = 0;
    if (threads < 1) threads = 1;
    for (int64_t i = 0; i < count && !status; i++) {
        jobs[i] = (product){.type = p[i].type, .w = p[i].w, .n = p[i].n, .k = p[i].k, .m = p[i].m, .x = p[i].x,
                            .y = p[i].y};
        if (p[i].n > 0 && p[i].m > 0) values += p[i].n * p[i].k;
    }
    if (!status) {
        rounding_list r = {.jobs = jobs, .twin = twin, .mems = mems, .activations = activations};
        int64_t rounded = twins(jobs, count, twin);
        sd_parallel(rounded > SD_CHUNK_FROM && activations != X_FLOAT ? threads : 1, count, 1, round_one, &r);
        status = r.bad ? -1 : 0;
    }
    for (int64_t i = 0; i < count && !status; i++) {
        product *j = &jobs[i], *t = twin[i] < 0 ? NULL : &jobs[twin[i]];
        if (t) j->q = t->q, j->d = t->d, j->s = t->s, j->hi = t->hi, j->lo = t->lo, j->xmin = t->xmin;
        first[i + 1] = first[i] + (j->n > 0 && j->m > 0 ? work_items(j, threads, activations) : 0);
    }
    if (!status && first[count] > 0) {
        if (values < SD_SPREAD_FROM) threads = 1;
        product_list l = {.jobs = jobs, .first = first, .count = count};
        sd_parallel(threads, first[count], first[count] / (8 * threads) + 1, product_set_of_list, &l);
    }
    for (int64_t i = 0; mems && i < count; i++) free(mems[i]);
    free(jobs), free(first), free(twin), free(mems);
    return status;
#else
    (void)threads;
    return count > 0 ? -1 : 0;
#endif
}
