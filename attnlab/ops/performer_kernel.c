/* Performer's FAVOR+ attention ("Rethinking Attention with Performers", arXiv:2009.14794, Sec. 2.2-2.4), fused for
 * the CPU, forward only.
 *
 * For one head, with W^T the (D, M) projection already scaled by D^(-1/4), each key y_j and query x_i:
 *
 *     keys:    p_j = W y_j,  c_j = exp(max_m p_jm - |y_j|^2 / (2 sqrt(D)) - C),  e_j = exp(p_j - max_m p_jm) c_j
 *              S = sum_j e_j v_j^T (M x D),  z = sum_j e_j (M)
 *     queries: p_i = W x_i,  f_i = exp(p_i - max_m p_im),  o_i = f_i^T S / max(f_i . z, eps)
 *
 * which is attnlab.ops.lowrank.performer_attention's arrangement (every exponent <= 0; C, the largest log c_j, is
 * tracked online: when a tile of keys raises it, S and z are rescaled). The (N, M) feature matrices never exist:
 * R tokens at a time are projected, exponentiated and folded into S (keys) or read out against S (queries) while
 * their M features sit in L1, and o_i goes straight to the output with its own strides.
 *
 * float32; head dim D in 16, 32, 48, 64 (a constant per instance); features M a multiple of 16, at most 1024.
 * attnlab/ops/performer_cpu.py builds and calls it; its measurements are in docs/perf.md.
 */
#include "kernel_f32.h"

#define MAX_FEATURES 1024
#define R 4 /* tokens per tile: R rows share every load of W^T and of S */

enum { Q, K, V, OUT, NT };

typedef struct {
    const float *ptr[NT]; /* OUT is written */
    int64_t stride[NT][3]; /* (batch, head, row) strides in elements; the feature stride is 1 */
    const float *wt;       /* (D, M) contiguous: W^T D^(-1/4) */
    int64_t H, N, D, M;
    float half_norm_scale; /* 1 / (2 sqrt(D)): |y|^2 / 2 for y = k D^(-1/4) */
    float eps;
} performer_args;

/* p[r] = rows[r] W^T for R rows; returns nothing, fills p (R x M) */
INLINE void project(const float *const rows[R], const float *wt, float *p, int64_t M, const int D) {
    int64_t m = 0;
    for (; m + 2 * L <= M; m += 2 * L) { /* two feature blocks: 2R independent accumulators hide FMA latency */
        vec a0[R], a1[R];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = splat(0.0f);
        for (int d = 0; d < D; d++) {
            const vec w0 = load(wt + d * M + m), w1 = load(wt + d * M + m + L);
            for (int r = 0; r < R; r++) {
                const vec x = splat(rows[r][d]);
                a0[r] += x * w0;
                a1[r] += x * w1;
            }
        }
        for (int r = 0; r < R; r++) {
            store(p + r * M + m, a0[r]);
            store(p + r * M + m + L, a1[r]);
        }
    }
    if (m < M) { /* an odd block */
        vec a0[R];
        for (int r = 0; r < R; r++) a0[r] = splat(0.0f);
        for (int d = 0; d < D; d++) {
            const vec w0 = load(wt + d * M + m);
            for (int r = 0; r < R; r++) a0[r] += splat(rows[r][d]) * w0;
        }
        for (int r = 0; r < R; r++) store(p + r * M + m, a0[r]);
    }
}

INLINE float row_max(const float *p, int64_t M) {
    vec mx = load(p);
    for (int64_t m = L; m < M; m += L) {
        const vec x = load(p + m);
        mx = blend(x > mx, x, mx);
    }
    return hmax(mx);
}

/* p <- exp(p - top) * weight */
INLINE void exp_row(float *p, int64_t M, float top, float weight) {
    const vec t = splat(top), w = splat(weight);
    for (int64_t m = 0; m < M; m += L) store(p + m, vexp(load(p + m) - t) * w);
}

INLINE float sum_squares(const float *x, const int D) {
    vec s = splat(0.0f);
    for (int d = 0; d < D; d += L) {
        const vec v = load(x + d);
        s += v * v;
    }
    return hsum(s);
}

/* One head: the key pass builds S (M x D) and z (M) in work, the query pass writes o. */
INLINE void performer_head(const performer_args *a, int64_t b, int64_t h, float *work, const int D) {
    const int64_t N = a->N, M = a->M;
    float *S = work, *z = S + M * D, *p = z + M; /* p: R x M features of the tile */
    const float *base[NT];
    for (int t = 0; t < NT; t++) base[t] = a->ptr[t] + b * a->stride[t][0] + h * a->stride[t][1];
    memset(S, 0, (size_t)(M * D + M) * sizeof(float));

    float C = -INFINITY;
    for (int64_t i = 0; i < N; i += R) {
        const float *k[R], *v[R];
        int valid[R];
        for (int r = 0; r < R; r++) { /* past the end, repeat the last row with weight 0 */
            const int64_t ir = i + r < N ? i + r : N - 1;
            valid[r] = i + r < N;
            k[r] = base[K] + ir * a->stride[K][2];
            v[r] = base[V] + ir * a->stride[V][2];
        }
        project(k, a->wt, p, M, D);
        float top[R], log_c[R], tile = -INFINITY;
        for (int r = 0; r < R; r++) {
            top[r] = row_max(p + r * M, M);
            log_c[r] = top[r] - a->half_norm_scale * sum_squares(k[r], D);
            if (valid[r] && log_c[r] > tile) tile = log_c[r];
        }
        if (tile > C) { /* a new largest exponent: rescale what S and z hold so far */
            if (C > -INFINITY) {
                const vec s = splat(expf(C - tile));
                for (int64_t j = 0; j < M * D + M; j += L) store(S + j, load(S + j) * s);
            }
            C = tile;
        }
        for (int r = 0; r < R; r++) exp_row(p + r * M, M, top[r], valid[r] ? expf(log_c[r] - C) : 0.0f);
        for (int64_t m = 0; m < M; m += L) {
            vec acc = load(z + m);
            for (int r = 0; r < R; r++) acc += load(p + r * M + m);
            store(z + m, acc);
        }
        vec vr[R][64 / L];
        for (int r = 0; r < R; r++)
            for (int x = 0; x < D / L; x++) vr[r][x] = load(v[r] + x * L);
        for (int64_t m = 0; m < M; m++) {
            float *row = S + m * D;
            for (int x = 0; x < D / L; x++) {
                vec acc = load(row + x * L);
                for (int r = 0; r < R; r++) acc += splat(p[r * M + m]) * vr[r][x];
                store(row + x * L, acc);
            }
        }
    }

    for (int64_t i = 0; i < N; i += R) {
        const float *q[R];
        for (int r = 0; r < R; r++) q[r] = base[Q] + (i + r < N ? i + r : N - 1) * a->stride[Q][2];
        project(q, a->wt, p, M, D);
        float den[R];
        for (int r = 0; r < R; r++) {
            float *f = p + r * M;
            exp_row(f, M, row_max(f, M), 1.0f);
            vec d = splat(0.0f);
            for (int64_t m = 0; m < M; m += L) d += load(f + m) * load(z + m);
            den[r] = 1.0f / fmaxf(hsum(d), a->eps); /* eps only guards 0 / 0 */
        }
        vec acc[R][64 / L];
        for (int r = 0; r < R; r++)
            for (int x = 0; x < D / L; x++) acc[r][x] = splat(0.0f);
        for (int64_t m = 0; m < M; m++) {
            for (int x = 0; x < D / L; x++) {
                const vec s = load(S + m * D + x * L);
                for (int r = 0; r < R; r++) acc[r][x] += splat(p[r * M + m]) * s;
            }
        }
        for (int r = 0; r < R && i + r < N; r++) {
            float *o = (float *)base[OUT] + (i + r) * a->stride[OUT][2];
            for (int x = 0; x < D / L; x++) store(o + x * L, acc[r][x] * splat(den[r]));
        }
    }
}

/* The handshake with attnlab/ops/performer_cpu.py: bump ATTNLAB_PERFORMER_ABI whenever an entry point or
   performer_args changes. */
#define ATTNLAB_PERFORMER_ABI 2
int64_t attnlab_abi(void) { return ATTNLAB_PERFORMER_ABI; }
int64_t attnlab_performer_args_size(void) { return (int64_t)sizeof(performer_args); }

/* 1 when a head dim D and M features are supported, else 0 */
int attnlab_performer_supports(int64_t D, int64_t M) {
    return (D == 16 || D == 32 || D == 48 || D == 64) && M >= L && M % L == 0 && M <= MAX_FEATURES;
}

/* Heads [start, end) of the (B, H) grid over `threads` OpenMP threads; head n is (b, h) = (n / H, n % H).
 * Returns 0, -1 if unsupported, -2 if a thread's working memory could not be allocated. */
int attnlab_performer_f32(const performer_args *a, int64_t start, int64_t end, int threads) {
    if (!attnlab_performer_supports(a->D, a->M)) return -1;
    const size_t bytes = (size_t)(a->M * a->D + a->M + R * a->M) * sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = thread_workspace(bytes);
        failed = work == NULL;
#pragma omp for schedule(static)
        for (int64_t n = start; n < end; n++) {
            if (!work) continue;
            const int64_t b = n / a->H, h = n % a->H;
            switch (a->D) { /* a constant D per case: unrolled, vectorised loops */
            case 16: performer_head(a, b, h, work, 16); break;
            case 32: performer_head(a, b, h, work, 32); break;
            case 48: performer_head(a, b, h, work, 48); break;
            default: performer_head(a, b, h, work, 64); break;
            }
        }
    }
    return failed ? -2 : 0;
}
