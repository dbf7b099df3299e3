/* A CPU decode step replayed from the list of its C calls (engine/kernels/plan.py records them,
 * engine/cpu_plans.py keeps a plan per window size).
 *
 * Why: a decode step of the demo model makes ~200 calls into this library, and the Python between them
 * (dispatch, checks, ctypes conversions) costs ~3 ms of a ~16 ms token on the 2-core test machine. A plan
 * makes the same calls, with the same arguments, in one. Only calls whose every argument is the same from
 * step to step can be planned: the tensors they name are kept by the plan, and what a step changes (tokens,
 * positions, sessions) is read from the batch's buffers by the kernels themselves (sd_attend_rows). */
#include <stdint.h>
#include <string.h>

#include "ops_cpu.h"
#include "quant_cpu.h"

#define PLAN_ARGS 20

typedef union {
    int64_t i;
    double f;
} sd_arg;

typedef struct {
    int64_t op;
    sd_arg a[PLAN_ARGS];
} sd_step;

/* The calls a plan can hold, in the order of their codes. */
#define PLAN_OPS(X)                                                                                          \
    X(sd_matmul) X(sd_matmul_packed) X(sd_dequantize_rows) X(sd_unpack_rows) X(sd_rms_norm) X(sd_rope)      \
        X(sd_attend_rows) X(sd_gated) X(sd_add) X(sd_add_rms_norm) X(sd_scale) X(sd_route) X(sd_swiglu_experts)

#define CODE(name) OP_##name,
enum { PLAN_OPS(CODE) OP_COUNT };
#define NAME(name) #name,
static const char *const names[] = {PLAN_OPS(NAME)};

int sd_plan_args(void) { return PLAN_ARGS; }

/* The code of the call `name` in a plan, -1 for a call a plan cannot hold. */
int sd_plan_op(const char *name) {
    for (int i = 0; i < OP_COUNT; i++)
        if (!strcmp(names[i], name)) return i;
    return -1;
}

#define I(j) (s->a[j].i)
#define P(j) ((void *)(intptr_t)s->a[j].i)
#define F(j) ((float)s->a[j].f)

/* Runs the steps in order; 0, or 1 + the index of the step whose call failed (or had an unknown code). */
int64_t sd_run_plan(const sd_step *steps, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        const sd_step *s = steps + j;
        int status = 0;
        switch (s->op) {
        case OP_sd_matmul: status = sd_matmul(I(0), P(1), I(2), I(3), P(4), I(5), P(6), I(7), I(8)); break;
        case OP_sd_matmul_packed: status = sd_matmul_packed(I(0), P(1), I(2), I(3), P(4), I(5), P(6), I(7), I(8)); break;
        case OP_sd_dequantize_rows: status = sd_dequantize_rows(I(0), P(1), I(2), I(3), P(4), I(5), P(6), I(7)); break;
        case OP_sd_unpack_rows: status = sd_unpack_rows(I(0), P(1), I(2), I(3), P(4), I(5), P(6), I(7)); break;
        case OP_sd_rms_norm: sd_rms_norm(P(0), I(1), P(2), P(3), I(4), I(5), I(6), F(7), I(8)); break;
        case OP_sd_rope: sd_rope(P(0), I(1), P(2), P(3), I(4), I(5), I(6), P(7), P(8), I(9), I(10)); break;
        case OP_sd_attend_rows:
            status = sd_attend_rows(P(0), I(1), P(2), I(3), P(4), I(5), I(6), P(7), P(8), I(9), I(10), I(11), P(12),
                                    P(13), I(14), I(15), I(16), F(17), P(18), I(19));
            break;
        case OP_sd_gated: sd_gated(I(0), P(1), I(2), P(3), I(4), P(5), I(6), I(7)); break;
        case OP_sd_add: sd_add(P(0), P(1), P(2), I(3)); break;
        case OP_sd_add_rms_norm: sd_add_rms_norm(P(0), P(1), P(2), P(3), P(4), I(5), I(6), F(7), I(8)); break;
        case OP_sd_scale: sd_scale(P(0), F(1), P(2), I(3)); break;
        case OP_sd_route: status = sd_route(P(0), I(1), I(2), P(3), I(4), I(5), I(6), P(7), P(8), I(9)); break;
        case OP_sd_swiglu_experts:
            status = sd_swiglu_experts(I(0), P(1), I(2), P(3), I(4), P(5), I(6), I(7), I(8), P(9), I(10), I(11), P(12),
                                       P(13), P(14), I(15), I(16));
            break;
        default: status = -1;
        }
        if (status) return j + 1;
    }
    return 0;
}
