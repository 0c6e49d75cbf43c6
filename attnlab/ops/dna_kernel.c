/* DnA's two-branch attention ("DnA: Denoising Attention for Visual Tasks", Sec. 3.2), fused for the CPU, forward only.
 *
 * For one head h and query row i, with keys k_j (j < M):
 *
 *     a_j = softmax_j(sp * q+_i . k_j + bp_ij),   b_j = softmax_j(sn * q-_i . k_j + bn_ij)
 *     o_i = sum_j a_j v+_j + alpha_h sum_j b_j v-_j
 *
 * The caller passes sn = -scale_neg and bn in negated-logit form (-B, and -inf at masked positions; see
 * attnlab.attention.dna.negative_bias), so the second softmax is DnA's softmin. Both branches share one pass over
 * K (transposed once per head into a local buffer), and o_i goes straight to the output with its own strides
 * (the head merge after it is a view). An optional per-head bias for each input (the projection's bias) is added
 * as the head's rows are copied, so the caller's projection can be a bias-free GEMM. When Q or V is shared
 * (variants q, v, shared, sum) the caller passes the same tensor twice (computed twice: one compiled instance per
 * head dim keeps the first build at a few seconds).
 *
 * float32 only, 64-byte vector types (GCC / Clang vector extensions; with AVX-512, intrinsics for max and for
 * exp's 2^n), exp by a Cephes-style polynomial (about 1 ulp); head dim D in 16, 32, 48, 64 (a constant per
 * instance), M <= 1024 keys. attnlab/ops/dna_cpu.py builds and calls it; where its time goes is in docs/perf.md.
 */
#include "kernel_f32.h"

#define MAX_M 1024

/* Tensors, each with its (batch, head, row) strides in elements; the feature stride is 1. */
enum { QP, QN, K, VP, VN, OUT, BP, BN, NT };

typedef struct {
    const float *ptr[NT]; /* BP / BN may be NULL (no bias); OUT is written */
    int64_t stride[NT][3];
    const float *in_bias[VN + 1]; /* per input QP..VN: (H, D) added to every token's vector (a projection's bias),
                                     or NULL */
    const float *alpha; /* (H,) */
    int64_t H, N, M, D;
    float scale_pos, scale_neg; /* scale_neg is negative for the softmin branch */
} dna_args;

/* One head's working set: K^T (zero-padded to whole vectors) and V+, V- as dense local copies. */
typedef struct {
    const float *kt, *vp, *vn;
    ivec tail; /* lanes of the last key block that hold a real key */
    int64_t M;
    int blocks, row; /* key blocks of L, row = blocks * L */
    float scale_pos, scale_neg, alpha;
} head;

/* Query rows are processed R at a time (register blocking: every K^T or V vector loaded serves R rows): R = 8 for
 * D = 16, else 4; the logits in groups of G = 8 / R key blocks and the weighted sums in chunks of C <= 2 output
 * vectors, so that each loop keeps 16 accumulators in registers. R = 4 rather than 2 measured ~8% faster at D = 64
 * (K^T and V then stream from L2 once per 4 rows). The last N mod R rows go one at a time (a class token makes
 * N = 65 in vit_cifar: a block of 8 for it alone would compute 7 rows for nothing). */

INLINE vec vmax(vec a, vec b) {
#ifdef __AVX512F__
    return (vec)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return blend(a > b, a, b);
#endif
}

INLINE void logit_blocks(const head *c, const float *const *qp, const float *const *qn, const float *const *bp,
                         const float *const *bn, float *pos, float *neg, vec *max_p, vec *max_n, int b0,
                         const int G, const int R, const int D, const int last) {
    /* scaled, biased logits of both branches for R rows and the G key blocks from b0, and their running maxima;
       last: b0 is the final, partial key block, whose padding lanes get -inf (weight exactly 0) */
    vec sp[R][G], sn[R][G];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) sp[r][g] = sn[r][g] = (vec){0};
    for (int d = 0; d < D; d++)
        for (int g = 0; g < G; g++) {
            const vec kv = load(c->kt + d * c->row + (b0 + g) * L);
            for (int r = 0; r < R; r++) {
                sp[r][g] += qp[r][d] * kv;
                sn[r][g] += qn[r][d] * kv;
            }
        }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int b = b0 + g;
            vec xp = sp[r][g] * splat(c->scale_pos), xn = sn[r][g] * splat(c->scale_neg);
            if (!last) {
                if (bp[r]) xp += load(bp[r] + b * L);
                if (bn[r]) xn += load(bn[r] + b * L);
            } else { /* a bias row holds M floats, read no further */
                for (int l = 0; b * L + l < c->M; l++) {
                    if (bp[r]) xp[l] += bp[r][b * L + l];
                    if (bn[r]) xn[l] += bn[r][b * L + l];
                }
                xp = blend(c->tail, xp, splat(-INFINITY));
                xn = blend(c->tail, xn, splat(-INFINITY));
            }
            store(pos + r * c->row + b * L, xp);
            store(neg + r * c->row + b * L, xn);
            max_p[r] = vmax(xp, max_p[r]);
            max_n[r] = vmax(xn, max_n[r]);
        }
}

INLINE float exp_row(const head *c, float *row, vec max) {
    /* row <- exp(row - max) (0 at the padding lanes, which hold -inf); returns 1 / sum, folded in by the caller */
    const vec mx = splat(hmax(max));
    vec sum = {0};
    for (int b = 0; b < c->blocks; b++) {
        const vec e = vexp(load(row + b * L) - mx);
        store(row + b * L, e);
        sum += e;
    }
    return 1.0f / hsum(sum);
}

INLINE void rows(const head *c, const float *const *qp, const float *const *qn, const float *const *bp,
                 const float *const *bn, float *const *out, float *pos, float *neg, const int R, const int D) {
    const int W = D / L, G = 8 / R, C = (8 / R >= 2 && W % 2 == 0) ? 2 : 1;
    vec max_p[R], max_n[R];
    for (int r = 0; r < R; r++) max_p[r] = max_n[r] = splat(-INFINITY);
    const int full = (int)(c->M / L);
    int b = 0;
    for (; b + G <= full; b += G) logit_blocks(c, qp, qn, bp, bn, pos, neg, max_p, max_n, b, G, R, D, 0);
    for (; b < full; b++) logit_blocks(c, qp, qn, bp, bn, pos, neg, max_p, max_n, b, 1, R, D, 0);
    if (full < c->blocks) logit_blocks(c, qp, qn, bp, bn, pos, neg, max_p, max_n, full, 1, R, D, 1);

    /* o = c+ sum_j e+_j v+_j + c- sum_j e-_j v-_j with c+ = 1 / sum e+, c- = alpha / sum e-, in column chunks */
    float c_pos[R], c_neg[R];
    for (int r = 0; r < R; r++) {
        float *pr = pos + r * c->row, *nr = neg + r * c->row;
        c_pos[r] = exp_row(c, pr, max_p[r]);
        c_neg[r] = c->alpha * exp_row(c, nr, max_n[r]);
    }
    for (int x0 = 0; x0 < W; x0 += C) {
        vec acc[R][C], acc_n[R][C];
        for (int r = 0; r < R; r++)
            for (int x = 0; x < C; x++) acc[r][x] = acc_n[r][x] = (vec){0};
        for (int64_t j = 0; j < c->M; j++)
            for (int x = 0; x < C; x++) {
                const vec v = load(c->vp + j * D + (x0 + x) * L), vn = load(c->vn + j * D + (x0 + x) * L);
                for (int r = 0; r < R; r++) {
                    acc[r][x] += pos[r * c->row + j] * v;
                    acc_n[r][x] += neg[r * c->row + j] * vn;
                }
            }
        for (int r = 0; r < R; r++)
            for (int x = 0; x < C; x++)
                store(out[r] + (x0 + x) * L, acc[r][x] * splat(c_pos[r]) + acc_n[r][x] * splat(c_neg[r]));
    }
}

INLINE vec bias_at(const float *bias, int d0) { return bias ? load(bias + d0) : (vec){0}; }

INLINE void transpose_keys(float *kt, const float *k, const float *bias, int64_t stride, int b, int64_t M, int row,
                           const int D) {
    /* kt[d][j] = k[j][d] + bias[d] for the keys j of block b (zeros past M), in 16 x 16 tiles: four rounds of
       interleaving row i with row i + 8 (the perfect-shuffle transpose) */
    for (int d0 = 0; d0 < D; d0 += L) {
        const vec bd = bias_at(bias, d0);
        vec t[L], u[L];
        for (int i = 0; i < L; i++) t[i] = b * L + i < M ? load(k + (b * L + i) * stride + d0) + bd : (vec){0};
        for (int round = 0; round < 4; round++) {
            for (int i = 0; i < L / 2; i++) {
                u[2 * i] = SHUFFLE(t[i], t[i + L / 2], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                u[2 * i + 1] = SHUFFLE(t[i], t[i + L / 2], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            }
            memcpy(t, u, sizeof t);
        }
        for (int i = 0; i < L; i++) store(kt + (d0 + i) * row + b * L, t[i]);
    }
}

INLINE float *copy_rows(float *dst, const float *src, int64_t stride, const float *bias, int64_t n, const int D) {
    /* dst[j] = src[j * stride] + bias, n dense rows of D; returns dst */
    if (!bias) {
        for (int64_t j = 0; j < n; j++) memcpy(dst + j * D, src + j * stride, sizeof(float) * D);
        return dst;
    }
    vec bd[D / L];
    for (int x = 0; x < D / L; x++) bd[x] = bias_at(bias, x * L);
    for (int64_t j = 0; j < n; j++)
        for (int x = 0; x < D / L; x++) store(dst + j * D + x * L, load(src + j * stride + x * L) + bd[x]);
    return dst;
}

INLINE void query_rows(const dna_args *a, const head *c, const float *const *p, const float *const *ib, int64_t i,
                       float *pos, float *neg, float *q_pos, float *q_neg, const int R, const int D) {
    /* the R query rows from i, each query biased into its local row when its projection has a bias */
    const float *qp[R], *qn[R], *bp[R], *bn[R];
    float *out[R];
    for (int r = 0; r < R; r++) {
        const int64_t ir = i + r;
        qp[r] = p[QP] + ir * a->stride[QP][2];
        qn[r] = p[QN] + ir * a->stride[QN][2];
        if (ib[QP]) qp[r] = copy_rows(q_pos + r * D, qp[r], 0, ib[QP], 1, D);
        if (ib[QN]) qn[r] = copy_rows(q_neg + r * D, qn[r], 0, ib[QN], 1, D);
        bp[r] = p[BP] ? p[BP] + ir * a->stride[BP][2] : NULL;
        bn[r] = p[BN] ? p[BN] + ir * a->stride[BN][2] : NULL;
        out[r] = (float *)p[OUT] + ir * a->stride[OUT][2];
    }
    rows(c, qp, qn, bp, bn, out, pos, neg, R, D);
}

/* Query rows per register block (see above) and the floats of one head's working memory, for head dim D and M
 * keys: K^T, V+, V-, both rows of logits and the biased query rows. Up to ~800 KiB (D = 64, M = 1024), so it lives
 * on the heap, never on a (possibly small) thread stack: one buffer per thread, kept for the thread's next call (a
 * fresh allocation of this size is an mmap whose pages fault in on every call). */
static int rows_per_block(int64_t D) { return D == L ? 8 : 4; }

static int64_t workspace_floats(int64_t D, int64_t M) {
    const int64_t row = (M + L - 1) / L * L, R = rows_per_block(D);
    return D * row + 2 * M * D + 2 * R * row + 2 * R * D;
}

INLINE void dna_head(const dna_args *a, int64_t bi, int64_t h, float *work, const int D) {
    const int64_t N = a->N, M = a->M;
    const int blocks = (int)((M + L - 1) / L), row = blocks * L, R = D == L ? 8 : 4;
    const float *p[NT], *ib[VN + 1];
    for (int t = 0; t < NT; t++)
        p[t] = a->ptr[t] ? a->ptr[t] + bi * a->stride[t][0] + h * a->stride[t][1] : NULL;
    for (int t = 0; t <= VN; t++) ib[t] = a->in_bias[t] ? a->in_bias[t] + h * D : NULL;

    /* dense local copies (input bias added): the inputs are rows of a wide projection output, one page apart */
    float *kt = work, *vp = kt + D * row, *vn = vp + M * D;
    ivec lane;
    for (int l = 0; l < L; l++) lane[l] = (blocks - 1) * L + l;
    for (int b = 0; b < blocks; b++) transpose_keys(kt, p[K], ib[K], a->stride[K][2], b, M, row, D);
    copy_rows(vp, p[VP], a->stride[VP][2], ib[VP], M, D);
    copy_rows(vn, p[VN], a->stride[VN][2], ib[VN], M, D);
    const head c = {kt, vp, vn, lane < (ivec){0} + (int32_t)M, M, blocks, row, a->scale_pos, a->scale_neg, a->alpha[h]};

    float *pos = vn + M * D, *neg = pos + R * row, *q_pos = neg + R * row, *q_neg = q_pos + R * D;
    int64_t i = 0;
    for (; i + R <= N; i += R) query_rows(a, &c, p, ib, i, pos, neg, q_pos, q_neg, R, D);
    for (; i < N; i++) query_rows(a, &c, p, ib, i, pos, neg, q_pos, q_neg, 1, D); /* the last N mod R rows */
}

/* The handshake with attnlab/ops/dna_cpu.py: bump ATTNLAB_DNA_ABI whenever an entry point or dna_args changes. */
#define ATTNLAB_DNA_ABI 2
int64_t attnlab_abi(void) { return ATTNLAB_DNA_ABI; }
int64_t attnlab_dna_args_size(void) { return (int64_t)sizeof(dna_args); }

/* 1 when a head dim D and M keys are supported, else 0 */
int attnlab_dna_supports(int64_t D, int64_t M) {
    return (D == 16 || D == 32 || D == 48 || D == 64) && M >= 1 && M <= MAX_M;
}

/* Heads [start, end) of the (B, H) grid over `threads` OpenMP threads; head m is (b, h) = (m / H, m % H).
 * Returns 0, -1 if unsupported, -2 if a thread's working memory could not be allocated. */
int attnlab_dna_f32(const dna_args *a, int64_t start, int64_t end, int threads) {
    if (!attnlab_dna_supports(a->D, a->M)) return -1;
    const size_t bytes = (size_t)workspace_floats(a->D, a->M) * sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = thread_workspace(bytes);
        failed = work == NULL;
#pragma omp for schedule(static)
        for (int64_t m = start; m < end; m++) {
            if (!work) continue;
            const int64_t b = m / a->H, h = m % a->H;
            switch (a->D) { /* a constant D per case: unrolled, vectorised loops */
            case 16: dna_head(a, b, h, work, 16); break;
            case 32: dna_head(a, b, h, work, 32); break;
            case 48: dna_head(a, b, h, work, 48); break;
            default: dna_head(a, b, h, work, 64); break;
            }
        }
    }
    return failed ? -2 : 0;
}
