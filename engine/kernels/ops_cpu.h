/* The float32 operations of ops_cpu.c and moe_cpu.c that plan_cpu.c replays. */
#ifndef SD_OPS_CPU_H
#define SD_OPS_CPU_H

#include <stdint.h>

void sd_rms_norm(const float *x, int64_t stride, const float *w, float *out, int64_t rows, int64_t groups,
                 int64_t dim, float eps, int threads);
void sd_rope(const float *x, int64_t stride, float *out, const int64_t *pos, int64_t rows, int64_t heads,
             int64_t dim, const float *cos_t, const float *sin_t, int neox, int threads);
int sd_attend_rows(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, int64_t rows, const int64_t *sessions, const int64_t *pos, int64_t heads,
                   int64_t kv_heads, int64_t d, void *k_cache, void *v_cache, int type, int64_t ring, int64_t window,
                   float scale, float *out, int threads);
void sd_gated(int kind, const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
              int64_t rows, int64_t n);
void sd_add(const float *x, const float *r, float *out, int64_t count);
void sd_add_rms_norm(const float *x, const float *r, const float *w, float *sum, float *normed, int64_t rows,
                     int64_t dim, float eps, int threads);
void sd_scale(const float *x, float s, float *out, int64_t count);

/* moe_cpu.c */
int sd_swiglu_experts(int gate_type, const uint8_t *gate, int up_type, const uint8_t *up, int down_type,
                      const uint8_t *down, int64_t experts, int64_t ff, int64_t hidden, const float *x, int64_t m,
                      int64_t k, const int64_t *ids, const float *weights, float *out, int threads, int activations);
int sd_route(const float *x, int64_t m, int64_t hidden, const float *router, int64_t experts, int64_t k, int normalize,
             float *weights, int64_t *ids, int threads);

#endif
