/* The block products of quant_cpu.c and packed_cpu.c that other kernels call. */
#ifndef SD_QUANT_CPU_H
#define SD_QUANT_CPU_H

#include <stdint.h>
#include <string.h>

/* GGUF type codes (ggml's) */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

/* A stack's type code with this bit set (sd_swiglu_experts): its matrices' rows packed by 16 (sd_pack). */
#define SD_PACKED 0x100

/* sd_matmul's `activations`: x float32 as given, or rounded to int16 or int8 (where sd_integer). */
enum { X_FLOAT = 0, X_INT16 = 1, X_INT8 = 2 };

/* y[m, n] = x[m, k] @ W[n, k]^T with W in GGUF `type` blocks: one product of sd_matmul_many (or of
 * sd_matmul_packed_many, W packed). */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t n, k;
    const float *x;
    int64_t m;
    float *y;
} sd_product;

int64_t sd_row_bytes(int type, int64_t k);
int sd_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
              int threads, int activations);
int sd_matmul_many(const sd_product *p, int64_t count, int threads, int activations);
int sd_matmul_packed(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                     int threads, int activations);
int sd_matmul_packed_many(const sd_product *p, int64_t count, int threads, int activations);
int sd_dequantize_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *rows, int64_t count, float *out,
                       int threads);
int sd_unpack_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *rows, int64_t count, float *out,
                   int threads);

/* x rows [m, k] rounded per `block` values to integers of at most `limit` (q int16 or q8 int8), a scale
 * per block in d, the sum of each 16 rounded values in s (AVX2 builds only). */
void sd_quantize_rows(const float *x, int64_t m, int64_t k, int64_t block, int limit, int16_t *q, int8_t *q8,
                      float *d, int32_t *s);

/* AMX tiles (tiles_cpu.c): sd_tiles() whether this build and process can use them (asked of the kernel once);
 * sd_tiles_product a packed group (16 weight rows at gw; Q8_0, Q5_0, Q4_K, Q6_K) against m x rows split into hi and
 * lo bytes (sd_split_rows: per block of 16 rows, fewer in the last, each run of 32 values as the rows' 32 bytes
 * one after another), as packed_cpu.c's int16 kernel (Q4_K: xmin the x blocks' scales times their sums,
 * dx[i] * float(s[2i] + s[2i + 1])); -1: no memory (or another type). */
int sd_tiles(void);
int sd_tiles_product(int type, const uint8_t *gw, int64_t k, const int8_t *hi, const uint8_t *lo, const float *dx,
                     const float *xmin, int64_t m, float *y, int64_t ys);
void sd_split_rows(const int16_t *q, int64_t m, int64_t k, int8_t *hi, uint8_t *lo);

/* The 6-bit scales and minimums of a Q4_K / Q5_K block's 8 sub-blocks, four per 32-bit word:
 * sub-blocks 0-3 keep 6 bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 take a nibble of bytes
 * 8-11 (low: scales, high: minimums) and the top 2 bits of bytes 0-3 (scales) or 4-7 (minimums)
 * above it. */
static inline void sd_k4_scales_mins(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t w[3], out[4];
    memcpy(w, s, 12);
    out[0] = w[0] & 0x3f3f3f3fu;
    out[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    out[2] = w[1] & 0x3f3f3f3fu;
    out[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, out, 8);
    memcpy(mn, out + 2, 8);
}

#endif
