/* What the C kernels build with: the AVX2/FMA/F16C intrinsics where the compiler targets them (SD_AVX2),
 * portable C otherwise or with -DSD_PORTABLE; INLINE for the walkers that must specialise per constant. */
#ifndef SD_SIMD_H
#define SD_SIMD_H

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SD_PORTABLE)
#include <immintrin.h>
#define SD_AVX2 1
#endif

#define INLINE static inline __attribute__((always_inline))

#endif
