/* IEEE half to float, for the C kernels. */
#ifndef SD_F16_H
#define SD_F16_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) && !defined(SD_PORTABLE)
#include <immintrin.h>
static inline float sd_f16(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float sd_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#endif
