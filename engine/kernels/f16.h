/* IEEE half and bfloat16 conversions for the C kernels, rounded as torch rounds. */
#ifndef SD_F16_H
#define SD_F16_H

#include <stdint.h>
#include <string.h>

/* float to bfloat16, rounded to nearest even (NaN kept a NaN), as torch's .to(bfloat16) */
static inline uint16_t sd_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

#if defined(__F16C__) && !defined(SD_PORTABLE)
#include <immintrin.h>
static inline float sd_f16(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t sd_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
/* float to half, rounded to nearest even, as torch's .to(float16) */
static inline uint16_t sd_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t sign = (bits >> 16) & 0x8000, exp = (bits >> 23) & 0xff, man = bits & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) { /* subnormal or zero */
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - e;
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* a carry into the exponent is right */
    return (uint16_t)(sign | half);
}

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

/* The little-endian half at p, as a float. */
static inline float sd_f16_at(const uint8_t *p) { return sd_f16((uint16_t)(p[0] | p[1] << 8)); }

#endif
