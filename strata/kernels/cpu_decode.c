/* The decode rows' work between a CPU stage's products (strata/kernels/cpu_decode.py builds and calls it): the
   residual add and RMSNorm, and the attention block (q/k norms, rotary, the K/V append, attention over the cells),
   one call each a layer instead of some hundred small torch ops (which cost a CPU stage of SmolLM2-135M more than
   its products did).

   Row invariance: every output is computed by one thread in one fixed order from its own row's inputs and its own
   sequence's cells, whatever the other rows of the window are and however the work is shared among threads. Built
   for AVX2 + FMA (x86-64-v3), with -ffp-contract=off: no multiply-add the source does not write. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s = x + delta (delta may be NULL; s written to `sum`, which may be x itself), out = (s * (1 / sqrt(mean(s * s) +
   eps))) * w: the squares summed in 8 fixed lanes and one fixed tree. */
static void norm_row(const float *x, const float *delta, const float *w, float eps, int64_t D, float *sum,
                     float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (delta)
            v = _mm256_add_ps(v, _mm256_loadu_ps(delta + i));
        _mm256_storeu_ps(sum + i, v);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float ss = hsum(acc);
    for (; i < D; i++) {
        float v = delta ? x[i] + delta[i] : x[i];
        sum[i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(ss / (float)D + eps)));
    const __m256 scale = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= D; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sum + i), scale),
                                                _mm256_loadu_ps(w + i)));
    for (; i < D; i++)
        out[i] = (sum[i] * inv) * w[i];
}

/* For each of the R rows of D floats: sum = x + delta, out = norm(sum) * w (a residual add and the next norm). */
void cpu_decode_rms_norm(const float *x, const float *delta, const float *w, float eps, int64_t R, int64_t D,
                         float *sum, float *out) {
    for (int64_t r = 0; r < R; r++)
        norm_row(x + r * D, delta ? delta + r * D : NULL, w, eps, D, sum + r * D, out + r * D);
}

/* One head vector of D floats into `out`: its RMSNorm (norm_w not NULL), then the rotate-half rotary over its
   first `rot` dims with this row's cos and sin [rot]: out[j] = x[j] * cos[j] + (-x[j + half]) * sin[j],
   out[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half] (torch's roundings: a product each, then the
   sum); the dims past `rot` as they are. */
static void prepare_head(const float *x, const float *norm_w, float eps, int D, int rot, const float *cos,
                         const float *sin, float *tmp, float *out) {
    const float *v = x;
    if (norm_w) {
        norm_row(x, NULL, norm_w, eps, D, out, tmp);  /* `out` holds the copy of x the norm writes beside it */
        v = tmp;
    }
    const int half = rot / 2;
    for (int j = 0; j < half; j++) {
        float a = v[j], b = v[j + half];
        float lo = a * cos[j] + (-b) * sin[j];
        float hi = b * cos[j + half] + a * sin[j + half];
        out[j] = lo;
        out[j + half] = hi;
    }
    for (int j = rot; j < D; j++)
        out[j] = v[j];
}

/* Decode rows' attention block, between the qkv and the o products. Row r of qkv [R][qkv_stride] holds H query heads
   (head h at h * q_head_stride: D floats, then its output gate's when q_head_stride is 2 D), then Hkv key heads and
   Hkv value heads of D floats. Row r is at position pos[r] of its sequence, whose cells are
   k_rows[r] / v_rows[r] + cell * s_cell (floats; a cell's heads D apart). First every row's key (normed by
   k_norm where given, turned) and value are written to cell pos[r]; then each query head (normed by q_norm where
   given, turned) attends to cells 0..pos[r] of its sequence, its K/V head h / (H / Hkv): score = (q . k) * scale,
   out [R][H][D] = (sum over cells of exp(score - max) * V) / (sum of exp(score - max)). D is a multiple of 8. Rows of one sequence may share
   a window (drafts: consecutive positions), as every row's cell is written before any row attends. Returns 1 where
   a buffer could not be had, else 0. */
int cpu_decode_attention(const float *qkv, int64_t R, int64_t qkv_stride, int H, int Hkv, int D, int q_head_stride,
                         int rot, const float *cos, const float *sin, const float *q_norm, const float *k_norm,
                         float eps, float *const *k_rows, float *const *v_rows, int64_t s_cell, const int64_t *pos,
                         float scale, float *out, int threads) {
    const int G = H / Hkv;
    const int64_t k_off = (int64_t)H * q_head_stride, v_off = k_off + (int64_t)Hkv * D;
    int64_t most = 0;
    for (int64_t r = 0; r < R; r++)
        most = pos[r] + 1 > most ? pos[r] + 1 : most;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *tmp = malloc(sizeof(float) * (2 * (size_t)D + (size_t)most));
        if (!tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < R * Hkv; t++) {
                const int64_t r = t / Hkv;
                const int h = (int)(t % Hkv);
                const float *row = qkv + r * qkv_stride;
                const int64_t cell = pos[r] * s_cell + (int64_t)h * D;
                prepare_head(row + k_off + (int64_t)h * D, k_norm, eps, D, rot, cos + r * rot, sin + r * rot, tmp,
                             k_rows[r] + cell);
                memcpy(v_rows[r] + cell, row + v_off + (int64_t)h * D, sizeof(float) * D);
            }  /* (the loop's closing barrier: every cell is written before any row reads it) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < R * H; t++) {
                const int64_t r = t / H;
                const int h = (int)(t % H), hk = h / G;
                const int64_t n = pos[r] + 1;
                float *q = tmp, *qn = tmp + D, *score = tmp + 2 * D;
                prepare_head(qkv + r * qkv_stride + (int64_t)h * q_head_stride, q_norm, eps, D, rot, cos + r * rot,
                             sin + r * rot, qn, q);
                const float *kc = k_rows[r] + (int64_t)hk * D;
                const float *vc = v_rows[r] + (int64_t)hk * D;
                float most_score = -INFINITY;
                int64_t c = 0;
                for (; c + 4 <= n; c += 4) {  /* four cells at a time: four sums in flight, each in its own order */
                    const float *k = kc + c * s_cell;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int d = 0; d < D; d += 8) {
                        const __m256 qd = _mm256_loadu_ps(q + d);
                        a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + d), a0);
                        a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + s_cell + d), a1);
                        a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 2 * s_cell + d), a2);
                        a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 3 * s_cell + d), a3);
                    }
                    score[c] = hsum(a0) * scale;
                    score[c + 1] = hsum(a1) * scale;
                    score[c + 2] = hsum(a2) * scale;
                    score[c + 3] = hsum(a3) * scale;
                }
                for (; c < n; c++) {  /* the same sum, one cell */
                    const float *k = kc + c * s_cell;
                    __m256 a0 = _mm256_setzero_ps();
                    for (int d = 0; d < D; d += 8)
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
                    score[c] = hsum(a0) * scale;
                }
                for (c = 0; c < n; c++)
                    most_score = score[c] > most_score ? score[c] : most_score;
                float total = 0.0f;
                for (c = 0; c < n; c++) {
                    const float p = expf(score[c] - most_score);
                    score[c] = p;
                    total += p;
                }
                const __m256 denom = _mm256_set1_ps(total);
                float *o = out + (r * H + h) * (int64_t)D;
                int d = 0;
                for (; d + 32 <= D; d += 32) {  /* 32 dims at a time over the cells in order (four sums in flight) */
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (c = 0; c < n; c++) {
                        const __m256 p = _mm256_set1_ps(score[c]);
                        const float *v = vc + c * s_cell + d;
                        a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
                        a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
                        a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
                        a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
                    }
                    _mm256_storeu_ps(o + d, _mm256_div_ps(a0, denom));
                    _mm256_storeu_ps(o + d + 8, _mm256_div_ps(a1, denom));
                    _mm256_storeu_ps(o + d + 16, _mm256_div_ps(a2, denom));
                    _mm256_storeu_ps(o + d + 24, _mm256_div_ps(a3, denom));
                }
                for (; d < D; d += 8) {  /* the same sums, 8 dims */
                    __m256 a0 = _mm256_setzero_ps();
                    for (c = 0; c < n; c++)
                        a0 = _mm256_fmadd_ps(_mm256_set1_ps(score[c]), _mm256_loadu_ps(vc + c * s_cell + d), a0);
                    _mm256_storeu_ps(o + d, _mm256_div_ps(a0, denom));
                }
            }
        }
        free(tmp);
    }
    return failed;
}

/* A product of the CPU's packed kernel (cpu_packed_linear, whose address the caller hands over). */
typedef int (*linear_fn)(int fmt, const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t N, int64_t rb,
                         const float *bias, float *y, int threads);

typedef struct {  /* a packed matrix [n][k]: records of row_bytes in the kernel's format `fmt`, and its bias */
    int64_t fmt, n, k, row_bytes;
    const uint8_t *data;
    const float *bias;
} Matrix;

typedef struct {  /* one attention layer of a stage, its MLP dense (gate_up, down) or routed experts (router) */
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm;  /* q_norm, k_norm NULL: none */
    Matrix qkv, o, gate_up, down;
    const float *router;  /* [n_experts][hidden] float32, NULL for a dense MLP; then gate_up / down are the experts' */
    int64_t n_experts, top_k, norm_topk, expert_dim, gate_up_stride, down_stride;  /* (bytes an expert) */
} Layer;

typedef struct {  /* the stage's shapes */
    int64_t n_layers, hidden, H, Hkv, D, q_head_stride, rot, inter;  /* inter: the dense MLPs' (0: none) */
    float eps, scale;
} Stage;

static void silu_mul(const float *gate_up, int64_t R, int64_t I, float *out) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gate_up[r * 2 * I + i];
            out[r * I + i] = (g / (1.0f + expf(-g))) * gate_up[r * 2 * I + I + i];
        }
}

static int product(linear_fn linear, const Matrix *m, const float *x, int64_t R, float *y, int threads) {
    return linear((int)m->fmt, x, R, m->k, m->data, m->n, m->row_bytes, m->bias, y, threads);
}

/* Decode rows' routed experts on packed weights: out [R][H] = for each row r, the sum over its k choices j in order
   of weight[r][j] * down_e(silu(gate) * up), gate | up = gate_up_e(x[r]), e = ids[r][j] (an id >= E adds nothing: an
   expert not held here). gate_up: E records [2I][gu_rb] bytes apart by gu_stride; down: E records [H][dn_rb] by
   dn_stride; formats gu_fmt, dn_fmt. Each expert a row routes to is one task (its rows gathered, its two products on
   one thread each, or every thread where the window routes to one expert): the threads share the experts, and every row's result is summed in its
   choices' order, whatever the other rows: a row alone equals itself beside others. Returns 1 where memory could
   not be had. */
int cpu_decode_experts(linear_fn linear, const float *x, int64_t R, int64_t H, int64_t I, int64_t k,
                       const int64_t *ids, const float *weight, int64_t E, int gu_fmt, const uint8_t *gate_up,
                       int64_t gu_stride, int64_t gu_rb, int dn_fmt, const uint8_t *down, int64_t dn_stride,
                       int64_t dn_rb, float *out, int threads) {
    const int64_t P = R * k;
    int64_t *order = malloc(sizeof(int64_t) * (P + 1)), *starts = malloc(sizeof(int64_t) * (P + 1));
    float *y = malloc(sizeof(float) * (P ? P : 1) * H);
    int failed = !order || !starts || !y, tasks = 0;
    if (!failed) {
        /* the pairs grouped by expert (a counting pass, stable), skipping ids not held here */
        int64_t n = 0;
        for (int64_t e = 0; e < E; e++) {
            int64_t first = n;
            for (int64_t p = 0; p < P; p++)
                if (ids[p] == e)
                    order[n++] = p;
            if (n > first)
                starts[tasks++] = first;
        }
        starts[tasks] = n;
    }
    const int inner = tasks == 1 ? threads : 1;  /* one expert: its products on every thread */
    const int n_tasks = failed ? 0 : tasks;
#pragma omp parallel num_threads(threads) if (n_tasks > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n_tasks; t++) {
            const int64_t first = starts[t], m = starts[t + 1] - first, e = ids[order[first]];
            float *xg = malloc(sizeof(float) * m * H), *gu = malloc(sizeof(float) * m * 2 * I);
            float *act = malloc(sizeof(float) * m * I), *yd = malloc(sizeof(float) * m * H);
            int bad = !xg || !gu || !act || !yd;
            if (!bad) {
                for (int64_t i = 0; i < m; i++)
                    memcpy(xg + i * H, x + order[first + i] / k * H, sizeof(float) * H);
                bad = linear(gu_fmt, xg, m, H, gate_up + e * gu_stride, 2 * I, gu_rb, NULL, gu, inner) != 0;
            }
            if (!bad) {
                silu_mul(gu, m, I, act);
                bad = linear(dn_fmt, act, m, I, down + e * dn_stride, H, dn_rb, NULL, yd, inner) != 0;
            }
            if (!bad)
                for (int64_t i = 0; i < m; i++)
                    memcpy(y + order[first + i] * H, yd + i * H, sizeof(float) * H);
            else {
#pragma omp atomic write
                failed = 1;
            }
            free(xg), free(gu), free(act), free(yd);
        }
    }
    if (!failed)
        for (int64_t r = 0; r < R; r++) {
            float *o = out + r * H;
            memset(o, 0, sizeof(float) * H);
            for (int64_t j = 0; j < k; j++) {
                const int64_t p = r * k + j;
                if (ids[p] < 0 || ids[p] >= E)
                    continue;
                const float w = weight[p], *yp = y + p * H;
                for (int64_t h = 0; h < H; h++)
                    o[h] = o[h] + w * yp[h];
            }
        }
    free(order), free(starts), free(y);
    return failed;
}

/* Each row's top-k experts as `strata.kernels.moe.route` picks them: softmax over h @ router.T (each logit summed
   in 8 fixed lanes and one fixed tree, the softmax in float32 in expert order), the k largest (on a tie the lower
   id first), renormalised to sum to 1 where norm_topk. ids, weight: [R][k]. */
static void route(const float *h, int64_t R, int64_t H, const float *router, int64_t E, int64_t k, int norm,
                  float *probs, int64_t *ids, float *weight) {
    for (int64_t r = 0; r < R; r++) {
        const float *x = h + r * H;
        float top = -INFINITY;
        for (int64_t e = 0; e < E; e++) {
            const float *w = router + e * H;
            __m256 acc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= H; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), acc);
            float l = hsum(acc);
            for (; i < H; i++)
                l += x[i] * w[i];
            probs[e] = l;
            top = l > top ? l : top;
        }
        float total = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            probs[e] = expf(probs[e] - top);
            total += probs[e];
        }
        float picked = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best]))
                    best = e;
            ids[r * k + j] = best;
            weight[r * k + j] = probs[best] / total;
            picked += weight[r * k + j];
            probs[best] = -1.0f;  /* taken */
        }
        if (norm)
            for (int64_t j = 0; j < k; j++)
                weight[r * k + j] = weight[r * k + j] / picked;
    }
}

/* A stage of attention layers over R decode rows in one call: x [R][hidden] (the rows' hidden states, the stage's
   input) becomes the stage's output, x + each layer's attention and MLP outputs in turn, the steps of the torch path
   (norm, qkv, `cpu_decode_attention`, o, add + norm, then gate_up, silu x up, down, or the routed experts:
   `route`, `cpu_decode_experts`) with the products on the packed kernel. cells[(layer * 2 + 0 or 1) * R + r]: row
   r's sequence's K or V cells of that layer (cell c at + c * s_cell). Returns 0, or 1 where memory could not be
   had (x then holds no meaningful rows). */
int cpu_decode_stage(const Stage *st, const Layer *layers, linear_fn linear, float *x, int64_t R, const float *cos,
                     const float *sin, float *const *cells, int64_t s_cell, const int64_t *pos, int threads) {
    const int64_t hd = st->hidden, qkv_n = layers[0].qkv.n, att_n = st->H * st->D, I = st->inter;
    int64_t most_experts = 1, most_k = 1;
    for (int64_t i = 0; i < st->n_layers; i++)
        if (layers[i].router) {
            most_experts = layers[i].n_experts > most_experts ? layers[i].n_experts : most_experts;
            most_k = layers[i].top_k > most_k ? layers[i].top_k : most_k;
        }
    float *h = malloc(sizeof(float) * R * hd);
    float *qkv = malloc(sizeof(float) * R * qkv_n), *att = malloc(sizeof(float) * R * att_n);
    float *delta = malloc(sizeof(float) * R * hd), *gu = malloc(sizeof(float) * (R * 2 * I + 1));
    float *act = malloc(sizeof(float) * (R * I + 1)), *probs = malloc(sizeof(float) * most_experts);
    float *weight = malloc(sizeof(float) * R * most_k);
    int64_t *ids = malloc(sizeof(int64_t) * R * most_k);
    int failed = !h || !qkv || !att || !delta || !gu || !act || !probs || !weight || !ids;
    for (int64_t i = 0; i < st->n_layers && !failed; i++) {
        const Layer *L = &layers[i];
        /* x + the last MLP's output (none before the first layer), normed */
        cpu_decode_rms_norm(x, i ? delta : NULL, L->attn_norm, st->eps, R, hd, x, h);
        failed |= product(linear, &L->qkv, h, R, qkv, threads) != 0;
        if (failed)
            break;
        failed |= cpu_decode_attention(qkv, R, qkv_n, (int)st->H, (int)st->Hkv, (int)st->D, (int)st->q_head_stride,
                                       (int)st->rot, cos, sin, L->q_norm, L->k_norm, st->eps, cells + (i * 2) * R,
                                       cells + (i * 2 + 1) * R, s_cell, pos, st->scale, att, threads) != 0;
        failed |= !failed && product(linear, &L->o, att, R, delta, threads) != 0;
        if (failed)
            break;
        cpu_decode_rms_norm(x, delta, L->mlp_norm, st->eps, R, hd, x, h);
        if (L->router) {
            route(h, R, hd, L->router, L->n_experts, L->top_k, (int)L->norm_topk, probs, ids, weight);
            failed |= cpu_decode_experts(linear, h, R, hd, L->expert_dim, L->top_k, ids, weight, L->n_experts,
                                         (int)L->gate_up.fmt, L->gate_up.data, L->gate_up_stride,
                                         L->gate_up.row_bytes, (int)L->down.fmt, L->down.data, L->down_stride,
                                         L->down.row_bytes, delta, threads) != 0;
            continue;
        }
        failed |= product(linear, &L->gate_up, h, R, gu, threads) != 0;
        if (failed)
            break;
        silu_mul(gu, R, I, act);
        failed |= product(linear, &L->down, act, R, delta, threads) != 0;
    }
    if (!failed)
        for (int64_t j = 0; j < R * hd; j++)
            x[j] = x[j] + delta[j];
    free(h), free(qkv), free(att), free(delta), free(gu), free(act), free(probs), free(weight), free(ids);
    return failed;
}
