/* Float32 vector helpers shared by attnlab's CPU kernels (dna_kernel.c, performer_kernel.c): 64-byte GCC / Clang
 * vector types, loads and stores, horizontal max and sum, exp for x <= 0 by a Cephes-style polynomial (about 1 ulp;
 * AVX-512 intrinsics where available), and a per-thread heap workspace. attnlab/ops/ckernel.py hashes this header
 * with each kernel's source, so editing it rebuilds them.
 */
#ifndef ATTNLAB_KERNEL_F32_H
#define ATTNLAB_KERNEL_F32_H
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define L 16      /* floats per vector */
#define INLINE static inline __attribute__((always_inline))

typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

INLINE vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
INLINE void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
INLINE vec splat(float x) { return (vec){0} + x; }
INLINE vec blend(ivec mask, vec a, vec b) { return (vec)(((ivec)a & mask) | ((ivec)b & ~mask)); }

/* horizontal max / sum by halving: 16 -> 8 -> 4 lanes in vector registers, then 4 scalars */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef int32_t i4 __attribute__((vector_size(16)));

INLINE v8 lo8(vec v) { v8 r; memcpy(&r, &v, sizeof r); return r; }
INLINE v8 hi8(vec v) { v8 r; memcpy(&r, (const char *)&v + sizeof r, sizeof r); return r; }
INLINE v4 lo4(v8 v) { v4 r; memcpy(&r, &v, sizeof r); return r; }
INLINE v4 hi4(v8 v) { v4 r; memcpy(&r, (const char *)&v + sizeof r, sizeof r); return r; }
INLINE v8 max8(v8 a, v8 b) { const i8 m = a > b; return (v8)(((i8)a & m) | ((i8)b & ~m)); }
INLINE v4 max4(v4 a, v4 b) { const i4 m = a > b; return (v4)(((i4)a & m) | ((i4)b & ~m)); }

INLINE float hsum(vec v) {
    const v8 s8 = lo8(v) + hi8(v);
    const v4 s4 = lo4(s8) + hi4(s8);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

INLINE float hmax(vec v) {
    const v8 m8 = max8(lo8(v), hi8(v));
    const v4 m4 = max4(lo4(m8), hi4(m8));
    const float a = m4[0] > m4[1] ? m4[0] : m4[1], b = m4[2] > m4[3] ? m4[2] : m4[3];
    return a > b ? a : b;
}

#ifdef __AVX512F__
INLINE vec vexp(vec x) {
    /* exp(x) for x <= 0 as below, with 2^n applied by vscalefps; 0 below -87 by a zeroing mask (an underflowing
       result would cost a microcode assist) */
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 v = _mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return (vec)_mm512_maskz_scalef_ps(keep, p, n);
}
#else
INLINE vec vexp(vec x) {
    /* exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, 2^n through the
       exponent bits; exactly 0 below -87 (and for -inf, a masked position) */
    const ivec keep = x >= splat(-87.0f);
    x = blend(keep, x, splat(-87.0f));
    const vec n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f); /* round */
    const vec r = (x - n * splat(0.693359375f)) + n * splat(2.12194440e-4f);
    vec p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return blend(keep, p * (vec)bits, splat(0.0f));
}
#endif

/* Working memory of the calling thread, grown on demand and kept for its next call; NULL if it cannot grow. */
static float *thread_workspace(size_t bytes) {
    static __thread float *buf = NULL;
    static __thread size_t size = 0;
    if (size < bytes) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, bytes) != 0) return NULL;
        free(buf);
        buf = grown;
        size = bytes;
    }
    return buf;
}

#endif
