/* What packed_cpu.c's kernels and tiles_cpu.c share of the packed Q4_K layout (AVX-512 builds). */
#ifndef SD_PACKED_H
#define SD_PACKED_H

#include <stdint.h>

#include "simd.h"

#if defined(SD_AVX2) && defined(__AVX512BW__)
/* A packed Q4_K group's super-block at blk: its 16 rows' scales (words 0, 1) and minimums (words 2, 3), sub-blocks
 * 4w..4w + 3 a byte each of every row's 32-bit lane (sd_k4_scales_mins, 16 rows at once). */
INLINE void sd_q4_k_words(const uint8_t *blk, __m512i words[4]) {
    const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f),
                  two = _mm512_set1_epi32(0x03030303);
    __m512i w0 = _mm512_loadu_si512(blk + 64), w1 = _mm512_loadu_si512(blk + 128), w2 = _mm512_loadu_si512(blk + 192);
    words[0] = _mm512_and_si512(w0, six);
    words[1] = _mm512_or_si512(_mm512_and_si512(w2, four), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), two), 4));
    words[2] = _mm512_and_si512(w1, six);
    words[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), four),
                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), two), 4));
}

/* Sub-block sb's scales (first = 0) or minimums (first = 2) of the 16 rows, as floats. */
INLINE __m512 sd_q4_k_field(const __m512i words[4], int first, int sb) {
    __m512i bytes = _mm512_srli_epi32(words[first + sb / 4], 8 * (sb % 4));
    return _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xff)));
}
#endif

#endif
