/* A decode window's or a prompt chunk's routed SwiGLU experts on the CPU in one call (engine/kernels/ops.py
 * `swiglu_experts`).
 *
 * Why in C: a layer of a MoE decode step is ~12 expert products plus the sort, the gathers, the silu
 * and the weighted sum, each a few microseconds of Python and torch dispatch; for a small model that
 * is most of the step (and of a prompt chunk, whose products are one per routed expert, 3 x 64 a
 * layer for the MoE demo). Here every routed expert runs its rows through sd_matmul (quant_cpu.c: each
 * expert's weights read once for the window), then each row sums its k outputs in its own order of
 * choices. A row's result depends on its own x and routing only: sd_matmul computes every row as
 * alone, and the silu and the sum are per row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int64_t sd_row_bytes(int type, int64_t k);
int sd_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
              int threads, int activations);

/* out[r] = sum over i of weights[r, i] * down_e(silu(gate_e(x[r])) * up_e(x[r])), e = ids[r, i], for the
 * m rows of x [m, hidden] with k experts each (i in order). gate and up hold `experts` matrices of ff rows
 * of `hidden` values, down `experts` of hidden rows of ff values, each stack's experts one after the
 * other, of the given GGUF types. Returns 0, or -1 for a bad type or expert id, or no memory. */
int sd_swiglu_experts(int gate_type, const uint8_t *gate, int up_type, const uint8_t *up, int down_type,
                      const uint8_t *down, int64_t experts, int64_t ff, int64_t hidden, const float *x, int64_t m,
                      int64_t k, const int64_t *ids, const float *weights, float *out, int threads, int activations) {
    int64_t gb = sd_row_bytes(gate_type, hidden), ub = sd_row_bytes(up_type, hidden), db = sd_row_bytes(down_type, ff);
    if (gb < 0 || ub < 0 || db < 0) return -1;
    for (int64_t p = 0; p < m * k; p++)
        if (ids[p] < 0 || ids[p] >= experts) return -1;
    /* scratch: the expert's x rows, its gate, up and silu(gate)*up rows, its outputs, every pair's output */
    float *xs = malloc(sizeof(float) * (size_t)(m * hidden + 3 * m * ff + m * hidden + m * k * hidden));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)m);
    if (!xs || !rows) {
        free(xs), free(rows);
        return -1;
    }
    float *g = xs + m * hidden, *u = g + m * ff, *h = u + m * ff, *y = h + m * ff, *pairs = y + m * hidden;
    int status = 0;
    for (int64_t e = 0; e < experts && !status; e++) {
        int64_t n = 0; /* the rows routed to e, in row order (a row routes an expert at most once) */
        for (int64_t p = 0; p < m * k; p++)
            if (ids[p] == e) rows[n++] = p;
        if (!n) continue;
        for (int64_t j = 0; j < n; j++) memcpy(xs + j * hidden, x + rows[j] / k * hidden, sizeof(float) * (size_t)hidden);
        status = sd_matmul(gate_type, gate + e * ff * gb, ff, hidden, xs, n, g, threads, activations) ||
                 sd_matmul(up_type, up + e * ff * ub, ff, hidden, xs, n, u, threads, activations);
        if (status) break;
        for (int64_t v = 0; v < n * ff; v++) h[v] = g[v] / (1.0f + expf(-g[v])) * u[v];
        status = sd_matmul(down_type, down + e * hidden * db, hidden, ff, h, n, y, threads, activations);
        for (int64_t j = 0; j < n && !status; j++)
            memcpy(pairs + rows[j] * hidden, y + j * hidden, sizeof(float) * (size_t)hidden);
    }
    for (int64_t r = 0; r < m && !status; r++) {
        float *o = out + r * hidden;
        for (int64_t v = 0; v < hidden; v++) o[v] = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            const float *yp = pairs + (r * k + i) * hidden;
            float w = weights[r * k + i];
            for (int64_t v = 0; v < hidden; v++) o[v] += w * yp[v];
        }
    }
    free(xs), free(rows);
    return status ? -1 : 0;
}
