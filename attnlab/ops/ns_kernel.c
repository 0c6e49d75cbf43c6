/* NS-Attn's transform T ("NS-Attention: Newton-Schulz Transformations of Attention Outputs in Vision
   Transformers", Algorithm 1), fused for the CPU: one pass per head matrix.
 *
 * For each (b, h) the head output X (N tokens x D features, rows strided, features contiguous) is read once into
 * the Gram matrix of the smaller side (G = X^T X when D <= N, else X X^T), the K polynomial steps run on that
 * n x n matrix (n = min(N, D)), and the output X Q (or Q X) is written straight to y with its own strides, so the
 * attention kernel's (B, N, H, D) buffer is neither copied in nor out. The algebra is the one of _ns_fast in
 * ns.py (see its docstring): with A = G / s^2, P = a I + b A + c A^2, P_K the product of the K step polynomials,
 * ||Z_K||_F^2 = sum(A * P_K^2) and Q = P_K * r / (s * max(||Z_K||_F, eps)); for K > NS_BLOCK, Z is re-formed
 * after every NS_BLOCK steps and the algebra restarts from its Gram.
 *
 * Plain C, no Python or torch headers: attnlab/ops/ckernel.py compiles it on first use (with OpenMP where the
 * compiler has it) and attnlab/ops/ns_cpu.py calls it through ctypes. Forward only (inference).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* compiled once per dtype: -DNS_DOUBLE gives attnlab_ns_f64 on doubles, the default attnlab_ns_f32 on floats */
#ifdef NS_DOUBLE
typedef double real;
#define SQRT sqrt
#define NS_ENTRY attnlab_ns_f64
#define NS_SUPPORTS attnlab_ns_supports_f64
#else
typedef float real;
#define SQRT sqrtf
#define NS_ENTRY attnlab_ns_f32
#define NS_SUPPORTS attnlab_ns_supports_f32
#endif

#define INLINE static inline __attribute__((always_inline))
#define NS_BLOCK 2 /* polynomial steps per Gram-space block; _BLOCK in ns.py */

/* 64-byte vectors (GCC/Clang vector extensions): 16 floats or 8 doubles, one AVX-512 register (two AVX2 ones).
 * Every helper gets the Gram side n as an argument and is inlined into ns_one, which ns_any calls with constant n and D,
 * so all loops unroll and the accumulators stay in registers. */
typedef real vec __attribute__((vector_size(64)));
#define L ((int)(sizeof(vec) / sizeof(real)))

INLINE vec load(const real *p) { vec v; memcpy(&v, p, sizeof v); return v; }
INLINE void store(real *p, vec v) { memcpy(p, &v, sizeof v); }

INLINE void rows_times(const real *a, int64_t rows, int64_t a_stride, const int inner, const real *b,
                       int64_t b_stride, real *out, int64_t out_stride, const int width) {
    /* out = a @ b: `rows` x `inner` times `inner` x `width` (width a multiple of L), rows `*_stride` apart */
    const int W = width / L;
    for (int64_t t = 0; t < rows; t++) {
        const real *at = a + t * a_stride;
        vec acc[64 / L] = {0}; /* width <= 64 */
        for (int k = 0; k < inner; k++)
            for (int w = 0; w < W; w++) acc[w] += at[k] * load(b + k * b_stride + w * L);
        for (int w = 0; w < W; w++) store(out + t * out_stride + w * L, acc[w]);
    }
}

INLINE void gram_rows(const real *x, int64_t rows, int64_t stride, real *g, const int n) {
    /* g = sum over rows t of x_t^T x_t, in blocks of R rows of g whose 16 vectors stay in registers */
    const int W = n / L;
    int R = W >= 16 ? 1 : 16 / W;
    while (n % R) R--; /* whole blocks only: 16 / W rows of 48 floats would run 2 rows past g and x_t */
    for (int i0 = 0; i0 < n; i0 += R) {
        vec acc[16] = {0};
        for (int64_t t = 0; t < rows; t++) {
            const real *xt = x + t * stride;
            for (int w = 0; w < W; w++) {
                const vec xv = load(xt + w * L);
                for (int i = 0; i < R; i++) acc[i * W + w] += xt[i0 + i] * xv;
            }
        }
        for (int i = 0; i < R; i++)
            for (int w = 0; w < W; w++) store(g + (i0 + i) * n + w * L, acc[i * W + w]);
    }
}

INLINE real dot(const real *a, const real *b, const int len) {
    /* sum(a * b) over len elements (a multiple of L) */
    vec acc = {0};
    for (int i = 0; i < len; i += L) acc += load(a + i) * load(b + i);
    real sum = 0;
    for (int l = 0; l < L; l++) sum += acc[l];
    return sum;
}

/* The working memory of one head matrix, in reals: seven n x n matrices and, in token space, X^T (D x n). Up to
 * ~250 KiB in double, so it lives on the heap, never on a (possibly small) thread stack: one buffer per thread,
 * kept for the thread's next call (a fresh allocation of this size is an mmap whose pages fault in every call). */
static int64_t workspace_reals(int64_t N, int64_t D) {
    const int64_t n = D <= N ? D : N;
    return 7 * n * n + (D <= N ? 0 : D * n);
}

INLINE void ns_one(const real *x, real *y, int64_t N, int64_t sxn, int64_t syn, int steps, real eps, real ca,
                   real cb, real cc, real *work, const int n, const int D) {
    /* one head matrix X (N x D, rows sxn apart); n = min(N, D); n and D are constants after inlining */
    real *g = work, *cur_buf = g + n * n, *sq = cur_buf + n * n, *p = sq + n * n, *pt_a = p + n * n,
         *pt_b = pt_a + n * n, *p_sq = pt_b + n * n, *xt_buf = p_sq + n * n;
    const int features = D <= N;

    /* Gram of the smaller side. Token space (N < D): X X^T is the feature Gram of X^T, so copy X^T (D x n) */
    if (features) {
        gram_rows(x, N, sxn, g, n);
    } else {
        for (int d = 0; d < D; d++)
            for (int i = 0; i < n; i++) xt_buf[d * n + i] = x[i * sxn + d];
        gram_rows(xt_buf, D, n, g, n);
    }

    /* eq. 2: r = ||M||_F = sqrt(tr G), s = max(r, eps), A = G / s^2 */
    real r_sq = 0;
    for (int i = 0; i < n; i++) r_sq += g[i * n + i];
    const real r = SQRT(r_sq);
    const real s = r > eps ? r : eps;
    const real inv_s2 = 1 / (s * s);
    real *A = g;
    for (int i = 0; i < n * n; i++) A[i] *= inv_s2;

    /* eq. 3, K times, in blocks of NS_BLOCK steps in Gram space: P = aI + bA_k + cA_k^2, P_B = P ... P,
     * A_{k+1} = A P_B^2. Between blocks Z = Z P_B is re-formed (into y, or in place in xt_buf in token space) and
     * A restarts from its Gram, because float32 rounding in a block's polynomial grows ~12x per step. */
    const real *src = x; /* Z's rows (features): X, then y once re-formed */
    int64_t src_stride = sxn;
    real div = s; /* Z = (current matrix) / div: X / s until Z is first re-formed */
    real *pt = pt_a, *spare = pt_b;
    for (int done = 0;;) {
        const int block = steps - done < NS_BLOCK ? steps - done : NS_BLOCK;
        const real *cur = A; /* Gram of Z after k steps of this block */
        for (int k = 0; k < block; k++) {
            rows_times(cur, n, n, n, cur, n, sq, n, n);
            for (int i = 0; i < n * n; i++) p[i] = cb * cur[i] + cc * sq[i];
            for (int i = 0; i < n; i++) p[i * n + i] += ca;
            if (k == 0) {
                memcpy(pt, p, sizeof(real) * n * n);
            } else {
                rows_times(p, n, n, n, pt, n, spare, n, n);
                real *t = pt; pt = spare; spare = t;
            }
            rows_times(pt, n, n, n, pt, n, p_sq, n, n);
            if (k + 1 < block) {
                rows_times(A, n, n, n, p_sq, n, cur_buf, n, n);
                cur = cur_buf;
            }
        }
        done += block;
        if (done == steps) break;
        const real inv_div = 1 / div;
        for (int i = 0; i < n * n; i++) pt[i] *= inv_div;
        div = 1;
        if (features) { /* row t of Z P reads only row t of Z, so y may be both source and target */
            rows_times(src, N, src_stride, n, pt, n, y, syn, n);
            src = y;
            src_stride = syn;
            gram_rows(y, N, syn, g, n);
        } else { /* Z^T P, row by row in place */
            rows_times(xt_buf, D, n, n, pt, n, xt_buf, n, n);
            gram_rows(xt_buf, D, n, g, n);
        }
    }

    /* eq. 4: ||Z_K||_F^2 = tr(A P_B^2) = sum(A * P_B^2); fold r / (div max(||Z_K||, eps)) into Q = P_B */
    const real z_sq = dot(A, p_sq, n * n);
    real z = SQRT(z_sq > 0 ? z_sq : 0);
    if (z < eps) z = eps;
    const real scale = r / (div * z);
    for (int i = 0; i < n * n; i++) pt[i] *= scale;

    /* output: Z Q (features) or Q Z (tokens), written with y's row stride */
    if (features) {
        rows_times(src, N, src_stride, n, pt, n, y, syn, n);
    } else if (steps <= NS_BLOCK) {
        rows_times(pt, n, n, n, x, sxn, y, syn, D);
    } else { /* Z^T Q in place, then transposed into y */
        rows_times(xt_buf, D, n, n, pt, n, xt_buf, n, n);
        for (int i = 0; i < n; i++)
            for (int d = 0; d < D; d++) y[i * syn + d] = xt_buf[d * n + i];
    }
}

/* The (n, D) pairs compiled, n = min(N, D): in feature space (D <= N) n = D, in token space (N < D) n = N.
 * One instance each, so that both are constants in ns_one. */
#define NS_SHAPES(X) X(16, 16) X(32, 32) X(48, 48) X(64, 64) X(16, 32) X(16, 48) X(16, 64) X(32, 48) X(32, 64) X(48, 64)

static int ns_any(const real *x, real *y, int64_t N, int64_t D, int64_t sxn, int64_t syn, int steps, real eps,
                  real ca, real cb, real cc, real *work) {
    const int64_t n = D <= N ? D : N;
#define NS_CALL(nv, dv) \
    if (n == nv && D == dv) { ns_one(x, y, N, sxn, syn, steps, eps, ca, cb, cc, work, nv, dv); return 0; }
    NS_SHAPES(NS_CALL)
#undef NS_CALL
    return -1;
}

/* 1 when head matrices of N tokens x D features are supported, else 0 */
int NS_SUPPORTS(int64_t N, int64_t D) {
    const int64_t n = D <= N ? D : N;
#define NS_MATCH(nv, dv) if (n == nv && D == dv) return 1;
    NS_SHAPES(NS_MATCH)
#undef NS_MATCH
    return 0;
}

static real *thread_workspace(size_t bytes) {
    static __thread real *buf = NULL;
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

/* The handshake with attnlab/ops/ns_cpu.py: bump ATTNLAB_NS_ABI whenever an entry point's arguments change. */
#define ATTNLAB_NS_ABI 2
int64_t attnlab_abi(void) { return ATTNLAB_NS_ABI; }
int64_t attnlab_ns_real_size(void) { return (int64_t)sizeof(real); }

/* Transforms matrices [start, end) of a (B, H, N, D) tensor, over `threads` OpenMP threads; matrix m is
 * (b, h) = (m / H, m % H). Strides are in elements; the feature stride of x and y must be 1. Returns 0, -1 for a
 * shape outside the limits above, -2 if a thread's working memory could not be allocated. */
int NS_ENTRY(const real *x, real *y, int64_t H, int64_t N, int64_t D, int64_t sxb, int64_t sxh,
             int64_t sxn, int64_t syb, int64_t syh, int64_t syn, int steps, real eps, real ca, real cb,
             real cc, int64_t start, int64_t end, int threads) {
    if (!NS_SUPPORTS(N, D)) return -1;
    const size_t bytes = (size_t)workspace_reals(N, D) * sizeof(real);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        real *work = thread_workspace(bytes);
        failed = work == NULL;
#pragma omp for schedule(static)
        for (int64_t m = start; m < end; m++) {
            if (!work) continue;
            const int64_t b = m / H, h = m % H;
            ns_any(x + b * sxb + h * sxh, y + b * syb + h * syh, N, D, sxn, syn, steps, eps, ca, cb, cc, work);
        }
    }
    return failed ? -2 : 0;
}
