/* The block products of quant_cpu.c that other kernels call. */
#ifndef SD_QUANT_CPU_H
#define SD_QUANT_CPU_H

#include <stdint.h>

/* y[m, n] = x[m, k] @ W[n, k]^T with W in GGUF `type` blocks: one product of sd_matmul_many. */
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

/* x rows [m, k] rounded per `block` values to integers of at most `limit` (q int16 or q8 int8), a scale
 * per block in d, the sum of each 16 rounded values in s (AVX2 builds only). */
void sd_quantize_rows(const float *x, int64_t m, int64_t k, int64_t block, int limit, int16_t *q, int8_t *q8,
                      float *d, int32_t *s);

#endif
