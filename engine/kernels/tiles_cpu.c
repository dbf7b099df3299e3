/* Packed products of many x rows on AMX tiles (Q8_0, Q5_0, Q4_K, Q6_K), the same bits as packed_cpu.c's int16 kernels.
 *
 * Why: a prompt's expert products are bound by the int16 multiply-adds (`vpdpwssd`, 32 a cycle at best);
 * one tile instruction takes 16 x rows times 16 weight rows times a sub-block. AMX multiplies int8 only,
 * so an int16 x value is split exactly, x = 256 * hi + lo (hi signed, lo unsigned bytes): a sub-block's
 * sum is 256 * (hi . q) + (lo . q), the same int32 as the int16 kernel's, and the float steps after it are
 * that kernel's in the same order, so every y is bit for bit what it gives.
 *
 * Per group of 16 weight rows the quants are first laid out as tiles, one a (sub-)block in the order the int16
 * kernel adds them (32 values, 8 rows of 4 values by 16 weight rows; Q6_K's sub-blocks 16 values, 4 rows), as the
 * values they stand for (Q5_0's with the fifth bit, minus 16; Q6_K's minus 32), then every 16 x rows run over them. */
#include <string.h>

#include "packed.h"
#include "pool.h"
#include "quant_cpu.h"
#include "simd.h"

#if defined(SD_AVX2) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int usable;
static pthread_once_t asked = PTHREAD_ONCE_INIT;

static void ask(void) { usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

int sd_tiles(void) { /* the kernel lends the tiles to a process once asked */
    pthread_once(&asked, ask);
    return usable;
}

/* Values of a sub-block: what one tile instruction sums along. */
INLINE int64_t tile_k(int type) { return type == T_Q6_K ? 16 : 32; }

/* Tile q's (sub-)block: its first x value in a row, and its x block of 32 (whose scale dx it takes). The tiles are
 * the blocks or sub-blocks in order, but Q6_K's (per super-block b, half h): sub-blocks 8h + 2i + ph, ph outer. */
INLINE int64_t x_at(int type, int64_t q) {
    return type != T_Q6_K ? 32 * q : 256 * (q / 16) + 128 * (q % 16 / 8) + 32 * (q % 4) + 16 * (q % 8 / 4);
}
/* Where tile q's x bytes start in a block of `rows` split rows (sd_split_rows' order: runs of 32 values, each the
 * rows' 32 bytes one after another, so a tile's rows are read at a stride of 32). */
INLINE int64_t x_tile_at(int type, int64_t q, int rows) { return x_at(type, q) / 32 * 32 * rows + x_at(type, q) % 32; }
INLINE int64_t dx_at(int type, int64_t q) { return type != T_Q6_K ? q : 8 * (q / 16) + 4 * (q % 16 / 8) + q % 4; }

/* tmm0, tmm1: `rows` x rows' hi and lo bytes of a sub-block; tmm2: its quants; tmm3-tmm4 and tmm5-tmm6: the int32
 * sums hi . q and lo . q, rows x 16, of two sub-blocks. Tiles of fewer rows take less time. */
static void configure(int type, int rows) {
    struct {
        uint8_t palette, start, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {.palette = 1};
    for (int t = 0; t < 7; t++) {
        cfg.colsb[t] = (uint16_t)(t < 2 ? tile_k(type) : 64);
        cfg.rows[t] = (uint8_t)(t == 2 ? tile_k(type) / 4 : rows);
    }
    _tile_loadconfig(&cfg);
}

/* 64 bytes of two pairs' quants (pair t's 16 rows x 2 values at 32 t) as a tile row: word 2r + t is pair t's word r. */
INLINE __m512i tile_row(__m512i pairs) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), pairs);
}

/* A packed Q4_K group's quants (nb super-blocks) as tiles (512 bytes each), each sub-block's d * scale and
 * dmin * min of the 16 rows. */
static void lay_out_q4_k(const uint8_t *gw, int64_t nb, uint8_t *tiles, float *ds, float *dm) {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++, gw += 16 * 144) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gw));
        __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gw + 32)));
        __m512i words[4];
        sd_q4_k_words(gw, words);
        for (int sb = 0; sb < 8; sb++) {
            _mm512_storeu_ps(ds + 16 * (8 * b + sb), _mm512_mul_ps(d, sd_q4_k_field(words, 0, sb)));
            _mm512_storeu_ps(dm + 16 * (8 * b + sb), _mm512_mul_ps(dmin, sd_q4_k_field(words, 2, sb)));
        }
        for (int j = 0; j < 4; j++) /* run j: low nibbles sub-block 2j, high ones 2j + 1 */
            for (int t = 0; t < 8; t++) {
                __m512i row = tile_row(_mm512_loadu_si512(gw + 256 + 32 * (16 * j + 2 * t)));
                uint8_t *low = tiles + 512 * (8 * b + 2 * j) + 64 * t;
                _mm512_storeu_si512(low, _mm512_and_si512(row, nibble));
                _mm512_storeu_si512(low + 512, _mm512_and_si512(_mm512_srli_epi16(row, 4), nibble));
            }
    }
}

/* A packed Q8_0 or Q5_0 group's values (nb blocks) as tiles (512 bytes each), each block's scales of the 16 rows. */
static void lay_out_blocks(int type, const uint8_t *gw, int64_t nb, uint8_t *tiles, float *ds) {
    const __m512i nibble = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    for (int64_t b = 0; b < nb; b++, gw += 16 * (type == T_Q5_0 ? 22 : 34)) {
        _mm512_storeu_ps(ds + 16 * b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gw)));
        for (int t = 0; t < 8; t++) { /* pairs 2t and 2t + 1 */
            __m512i pairs;
            if (type == T_Q8_0) {
                pairs = _mm512_loadu_si512(gw + 32 + 64 * t);
            } else { /* (low | fifth << 4) - 16, as packed_cpu.c's pair16 */
                __m512i bytes = _mm512_loadu_si512(gw + 96 + 32 * (2 * t % 8));
                __m512i low = _mm512_and_si512(t < 4 ? bytes : _mm512_srli_epi16(bytes, 4), nibble);
                uint64_t fifth;
                memcpy(&fifth, gw + 32 + 8 * t, 8);
                pairs = _mm512_mask_sub_epi8(low, (__mmask64)~fifth, low, sixteen);
            }
            _mm512_storeu_si512(tiles + 512 * b + 64 * t, tile_row(pairs));
        }
    }
}

/* A packed Q6_K group's quants minus 32 (nb super-blocks) as tiles (256 bytes each, in x_at's order), each
 * sub-block's d * scale of the 16 rows. */
static void lay_out_q6_k(const uint8_t *gw, int64_t nb, uint8_t *tiles, float *ds) {
    const __m512i nibble = _mm512_set1_epi8(15), bits = _mm512_set1_epi8(3), off = _mm512_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++, gw += 16 * 210) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gw));
        for (int64_t q = 16 * b; q < 16 * b + 16; q++) {
            int sb = 8 * (int)(q % 16 / 8) + 2 * (int)(q % 4) + (int)(q % 8 / 4);
            __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(gw + 32 + 16 * sb)));
            _mm512_storeu_ps(ds + 16 * q, _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale)));
        }
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 16; p += 2) { /* pairs p and p + 1: row p % 8 / 2 of the tiles of ph = p / 8 */
                const uint8_t *c = gw + 288 + 96 * (16 * h + p);
                __m512i parts[3]; /* qh, the low run's ql, the high run's ql: both pairs, 32 bytes each */
                for (int i = 0; i < 3; i++)
                    parts[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c + 32 * i))),
                                                  _mm256_loadu_si256((const __m256i *)(c + 96 + 32 * i)), 1);
                for (int i = 0; i < 4; i++) {
                    __m512i low = i % 2 ? parts[2] : parts[1];
                    low = _mm512_and_si512(i < 2 ? low : _mm512_srli_epi16(low, 4), nibble);
                    __m512i top = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(parts[0], 2 * i), bits), 4);
                    __m512i values = _mm512_sub_epi8(_mm512_or_si512(low, top), off);
                    int64_t q = 16 * b + 8 * h + 4 * (p / 8) + i;
                    _mm512_storeu_si512(tiles + 256 * q + 64 * (p % 8 / 2), tile_row(values));
                }
            }
    }
}

/* Tile q's products for 16 x rows against the group's 16 weight rows into tiles H and L (hi . q, lo . q), and
 * those tiles to memory (the tile numbers are literals: the intrinsics name them in assembly). */
#define PRODUCTS(H, L, q)                                                                                              \
    do {                                                                                                               \
        _tile_loadd(0, hi + x_tile_at(type, q, rows), 32);                                                             \
        _tile_loadd(1, lo + x_tile_at(type, q, rows), 32);                                                             \
        _tile_loadd(2, tiles + 16 * tile_k(type) * (q), 64);                                                           \
        _tile_zero(H);                                                                                                 \
        _tile_zero(L);                                                                                                 \
        _tile_dpbssd(H, 0, 2);                                                                                         \
        _tile_dpbusd(L, 1, 2);                                                                                         \
    } while (0)
#define STORE(H, L, sums)                                                                                              \
    do {                                                                                                               \
        _tile_stored(H, (sums)[0], 64);                                                                                \
        _tile_stored(L, (sums)[1], 64);                                                                                \
    } while (0)

/* f[r] += tile q's (sub-)block of row r (its int32 sums in c): as packed_cpu.c's groups_int, group_q4_k or
 * group_q6_k, step for step. */
INLINE void add_tile(int type, __m512 *f, int32_t c[2][16][16], const float *ds, const float *dm, const float *dx,
                     const float *xmin, int64_t k, int64_t q, int rows) {
    __m512 scale = _mm512_loadu_ps(ds + 16 * q), mins = type == T_Q4_K ? _mm512_loadu_ps(dm + 16 * q) : scale;
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[0][r]), 8), _mm512_load_si512(c[1][r]));
        int64_t at = r * (k / 32) + dx_at(type, q);
        float dxs = dx[at];
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(dxs)), f[r]);
        if (type == T_Q4_K) f[r] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(xmin[at]), f[r]);
    }
}

/* y[i, 16 g..] for `rows` x rows (<= 16, the tiles configured for as many). Tiles in pairs, tmm3-4 and tmm5-6 in
 * turn: the next tile's products run while this one's floats are added, and are stored after them. */
INLINE void tile_rows(int type, const uint8_t *tiles, const float *ds, const float *dm, int64_t k, const int8_t *hi,
                      const uint8_t *lo, const float *dx, const float *xmin, int rows, float *y, int64_t ys) {
    int32_t sums[2][2][16][16] __attribute__((aligned(64)));
    __m512 f[16];
    int64_t n = k / tile_k(type);
    for (int r = 0; r < 16; r++) f[r] = _mm512_setzero_ps();
    PRODUCTS(3, 4, 0);
    STORE(3, 4, sums[0]);
    for (int64_t q = 0; q < n; q += 2) {
        if (q + 1 == n) { /* an odd count's last */
            add_tile(type, f, sums[0], ds, dm, dx, xmin, k, q, rows);
            break;
        }
        PRODUCTS(5, 6, q + 1);
        add_tile(type, f, sums[0], ds, dm, dx, xmin, k, q, rows);
        STORE(5, 6, sums[1]);
        if (q + 2 < n) PRODUCTS(3, 4, q + 2);
        add_tile(type, f, sums[1], ds, dm, dx, xmin, k, q + 1, rows);
        if (q + 2 < n) STORE(3, 4, sums[0]);
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * ys, f[r]);
}

/* Thread-local room for a group's tiles (16 bytes a value) and its scales and minimums (a float a row and
 * sub-block each at most), grown as k needs and kept for the thread's later calls. */
static uint8_t *room(int64_t k) {
    static __thread void *mem;
    static __thread size_t size;
    return sd_kept(&mem, &size, (size_t)(16 * k + 2 * (k / 16) * 16 * (int64_t)sizeof(float)));
}

/* The whole group, a constant type each (the row loop specialised, the f sums kept in registers). */
INLINE void group_rows(int type, const uint8_t *tiles, const float *ds, const float *dm, int64_t k, const int8_t *hi,
                       const uint8_t *lo, const float *dx, const float *xmin, int64_t m, float *y, int64_t ys) {
    for (int64_t i = 0; i < m; i += 16) {
        const float *mins = type == T_Q4_K ? xmin + i * (k / 32) : NULL;
        if (m - i >= 16) {
            tile_rows(type, tiles, ds, dm, k, hi + i * k, lo + i * k, dx + i * (k / 32), mins, 16, y + i * ys, ys);
        } else { /* the last rows, tiles of as many */
            configure(type, (int)(m - i));
            tile_rows(type, tiles, ds, dm, k, hi + i * k, lo + i * k, dx + i * (k / 32), mins, (int)(m - i), y + i * ys, ys);
        }
    }
}

int sd_tiles_product(int type, const uint8_t *gw, int64_t k, const int8_t *hi, const uint8_t *lo, const float *dx,
                     const float *xmin, int64_t m, float *y, int64_t ys) {
    uint8_t *tiles = room(k);
    if (!tiles) return -1;
    float *ds = (float *)(tiles + 16 * k), *dm = ds + (k / 16) * 16;
    configure(type, 16);
    switch (type) {
    case T_Q4_K:
        lay_out_q4_k(gw, k / 256, tiles, ds, dm);
        group_rows(T_Q4_K, tiles, ds, dm, k, hi, lo, dx, xmin, m, y, ys);
        break;
    case T_Q6_K:
        lay_out_q6_k(gw, k / 256, tiles, ds);
        group_rows(T_Q6_K, tiles, ds, dm, k, hi, lo, dx, xmin, m, y, ys);
        break;
    case T_Q8_0:
        lay_out_blocks(T_Q8_0, gw, k / 32, tiles, ds);
        group_rows(T_Q8_0, tiles, ds, dm, k, hi, lo, dx, xmin, m, y, ys);
        break;
    case T_Q5_0:
        lay_out_blocks(T_Q5_0, gw, k / 32, tiles, ds);
        group_rows(T_Q5_0, tiles, ds, dm, k, hi, lo, dx, xmin, m, y, ys);
        break;
    default:
        _tile_release();
        return -1;
    }
    _tile_release();
    return 0;
}

void sd_split_rows(const int16_t *q, int64_t m, int64_t k, int8_t *hi, uint8_t *lo) {
    const __m512i low = _mm512_set1_epi16(0xff);
    for (int64_t i = 0; i < m; i += 16) {
        int64_t rows = m - i < 16 ? m - i : 16;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < k; c += 32) {
                __m512i v = _mm512_loadu_si512(q + (i + r) * k + c);
                int64_t at = i * k + c * rows + 32 * r;
                _mm256_storeu_si256((__m256i *)(hi + at), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
                _mm256_storeu_si256((__m256i *)(lo + at), _mm512_cvtepi16_epi8(_mm512_and_si512(v, low)));
            }
    }
}
#else
int sd_tiles(void) { return 0; }
int sd_tiles_product(int type, const uint8_t *gw, int64_t k, const int8_t *hi, const uint8_t *lo, const float *dx,
                     const float *xmin, int64_t m, float *y, int64_t ys) {
    (void)type, (void)gw, (void)k, (void)hi, (void)lo, (void)dx, (void)xmin, (void)m, (void)y, (void)ys;
    return -1;
}
void sd_split_rows(const int16_t *q, int64_t m, int64_t k, int8_t *hi, uint8_t *lo) { (void)q, (void)m, (void)k, (void)hi, (void)lo; }
#endif
