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

#endif
