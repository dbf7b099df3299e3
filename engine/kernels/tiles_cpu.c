/* Packed Q4_K products of many x rows on AMX tiles, the same bits as packed_cpu.c's int16 kernel.
 *
 * Why: a prompt's expert products are bound by the int16 multiply-adds (`vpdpwssd`, 32 a cycle at best);
 * one tile instruction takes 16 x rows times 16 weight rows times 32 values. AMX multiplies int8 only,
 * so an int16 x value is split exactly, x = 256 * hi + lo (hi signed, lo unsigned bytes): a sub-block's
 * sum is 256 * (hi . q) + (lo . q), the same int32 as the int16 kernel's, and the float steps after it are
 * that kernel's in the same order, so every y is bit for bit what it gives.
 *
 * Per group of 16 weight rows the quants are first laid out as tiles (`sub-block` s: 8 rows of 4 values
 * by 16 weight rows), then every 16 x rows run over them. */
#include <stdlib.h>
#include <string.h>

#include "packed.h"
#include "quant_cpu.h"
#include "simd.h"

#if defined(SD_AVX2) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define Q4K_BYTES 144 /* a super-block of one row */

int sd_tiles(void) {
    static int usable = -1; /* the kernel asks once for the process; a race asks twice, harmlessly */
    if (usable < 0) usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return usable;
}

/* tmm0, tmm1: 16 x rows' hi and lo bytes of a sub-block (32); tmm2: its quants, 8 rows of 16 weight rows x 4;
 * tmm3-tmm4 and tmm5-tmm6: the int32 sums hi . q and lo . q, 16 x 16, of two sub-blocks. */
static void configure(void) {
    struct {
        uint8_t palette, start, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {.palette = 1};
    for (int t = 0; t < 7; t++) {
        cfg.colsb[t] = t < 2 ? 32 : 64;
        cfg.rows[t] = t == 2 ? 8 : 16;
    }
    _tile_loadconfig(&cfg);
}

/* A packed group's quants (k values, nb super-blocks) as tiles: sub-block s at tiles + 512 s, its row t the 16
 * weight rows' values 4t..4t + 3; and each sub-block's d * scale and dmin * min of the 16 rows. */
static void lay_out(const uint8_t *gw, int64_t nb, uint8_t *tiles, float *dsc, float *dmn) {
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512i order; /* word 2r + t of a tile row: pair t's word r */
    uint16_t idx[32];
    for (int r = 0; r < 16; r++) idx[2 * r] = (uint16_t)r, idx[2 * r + 1] = (uint16_t)(16 + r);
    order = _mm512_loadu_si512(idx);
    for (int64_t b = 0; b < nb; b++, gw += 16 * Q4K_BYTES) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gw));
        __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gw + 32)));
        __m512i words[4];
        sd_q4_k_words(gw, words);
        for (int sb = 0; sb < 8; sb++) {
            _mm512_storeu_ps(dsc + 16 * (8 * b + sb), _mm512_mul_ps(d, sd_q4_k_field(words, 0, sb)));
            _mm512_storeu_ps(dmn + 16 * (8 * b + sb), _mm512_mul_ps(dmin, sd_q4_k_field(words, 2, sb)));
        }
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 8; t++) {
                __m512i pairs = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(gw + 256 + 32 * (16 * j + 2 * t)));
                uint8_t *low = tiles + 512 * (8 * b + 2 * j) + 64 * t;
                _mm512_storeu_si512(low, _mm512_and_si512(pairs, nibble));
                _mm512_storeu_si512(low + 512, _mm512_and_si512(_mm512_srli_epi16(pairs, 4), nibble));
            }
    }
}

/* Sub-block s's products for 16 x rows against the group's 16 weight rows into tiles H and L (hi . q, lo . q),
 * and those tiles to memory (the tile numbers are literals: the intrinsics name them in assembly). */
#define PRODUCTS(H, L, s)                                                                                                 \
    do {                                                                                                               \
        _tile_loadd(0, hi + 32 * (s), k);                                                                              \
        _tile_loadd(1, lo + 32 * (s), k);                                                                              \
        _tile_loadd(2, tiles + 512 * (s), 64);                                                                         \
        _tile_zero(H);                                                                                                 \
        _tile_zero(L);                                                                                             \
        _tile_dpbssd(H, 0, 2);                                                                                         \
        _tile_dpbusd(L, 1, 2);                                                                                     \
    } while (0)
#define STORE(H, L, sums)                                                                                                 \
    do {                                                                                                               \
        _tile_stored(H, (sums)[0], 64);                                                                                \
        _tile_stored(L, (sums)[1], 64);                                                                            \
    } while (0)

/* f[r] += sub-block s of row r (its int32 sums in c): as packed_cpu.c's group_q4_k, step for step. */
INLINE void add_sub_block(__m512 *f, int32_t c[2][16][16], const float *dsc, const float *dmn, const float *dx,
                          const int32_t *xs, int64_t k, int64_t s, int rows) {
    __m512 ds = _mm512_loadu_ps(dsc + 16 * s), dm = _mm512_loadu_ps(dmn + 16 * s);
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[0][r]), 8), _mm512_load_si512(c[1][r]));
        int64_t at = r * (k / 32) + s;
        float dxs = dx[at], xsum = (float)(xs[2 * at] + xs[2 * at + 1]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ds, _mm512_set1_ps(dxs)), f[r]);
        f[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(dxs * xsum), f[r]);
    }
}

/* y[i, 16 g..] for the rows of x from i0, `rows` of them (<= 16; hi and lo hold 16 from i0, zeros past m).
 * Sub-blocks in pairs, tiles 3-4 and 5-6 in turn: the next sub-block's products run while this one's floats are
 * added, and are stored after them. */
INLINE void tile_rows(const uint8_t *tiles, const float *dsc, const float *dmn, int64_t k, const int8_t *hi,
                      const uint8_t *lo, const float *dx, const int32_t *xs, int rows, float *y, int64_t ys) {
    int32_t sums[2][2][16][16] __attribute__((aligned(64)));
    __m512 f[16];
    int64_t n = k / 32; /* even: k is a multiple of 256 */
    for (int r = 0; r < 16; r++) f[r] = _mm512_setzero_ps();
    PRODUCTS(3, 4, 0);
    STORE(3, 4, sums[0]);
    for (int64_t s = 0; s < n; s += 2) {
        PRODUCTS(5, 6, s + 1);
        add_sub_block(f, sums[0], dsc, dmn, dx, xs, k, s, rows);
        STORE(5, 6, sums[1]);
        if (s + 2 < n) PRODUCTS(3, 4, s + 2);
        add_sub_block(f, sums[1], dsc, dmn, dx, xs, k, s + 1, rows);
        if (s + 2 < n) STORE(3, 4, sums[0]);
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * ys, f[r]);
}

/* Thread-local room for a group's tiles and scales, grown as k needs (kept for the thread's later calls). */
static uint8_t *room(int64_t k) {
    static __thread uint8_t *mem;
    static __thread int64_t size;
    int64_t need = 16 * k + 2 * (k / 32) * 16 * (int64_t)sizeof(float);
    if (need > size) {
        free(mem);
        mem = aligned_alloc(64, (size_t)(need + 63) / 64 * 64);
        size = mem ? need : 0;
    }
    return mem;
}

int sd_tiles_q4_k(const uint8_t *gw, int64_t k, const int8_t *hi, const uint8_t *lo, const float *dx, const int32_t *xs,
                  int64_t m, float *y, int64_t ys) {
    uint8_t *tiles = room(k);
    if (!tiles) return -1;
    float *dsc = (float *)(tiles + 16 * k), *dmn = dsc + (k / 32) * 16;
    configure();
    lay_out(gw, k / 256, tiles, dsc, dmn);
    for (int64_t i = 0; i < m; i += 16)
        if (m - i >= 16) /* a constant row count keeps the 16 sums in registers */
            tile_rows(tiles, dsc, dmn, k, hi + i * k, lo + i * k, dx + i * (k / 32), xs + i * (k / 16), 16, y + i * ys, ys);
        else
            tile_rows(tiles, dsc, dmn, k, hi + i * k, lo + i * k, dx + i * (k / 32), xs + i * (k / 16), (int)(m - i),
                      y + i * ys, ys);
    _tile_release();
    return 0;
}

void sd_split_rows(const int16_t *q, int64_t m, int64_t k, int8_t *hi, uint8_t *lo) {
    for (int64_t i = 0; i < m * k; i++) {
        hi[i] = (int8_t)(q[i] >> 8);
        lo[i] = (uint8_t)(q[i] & 0xff);
    }
}
#else
int sd_tiles(void) { return 0; }
int sd_tiles_q4_k(const uint8_t *gw, int64_t k, const int8_t *hi, const uint8_t *lo, const float *dx, const int32_t *xs,
                  int64_t m, float *y, int64_t ys) {
    (void)gw, (void)k, (void)hi, (void)lo, (void)dx, (void)xs, (void)m, (void)y, (void)ys;
    return -1;
}
void sd_split_rows(const int16_t *q, int64_t m, int64_t k, int8_t *hi, uint8_t *lo) { (void)q, (void)m, (void)k, (void)hi, (void)lo; }
#endif
