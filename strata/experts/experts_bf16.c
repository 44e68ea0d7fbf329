/* The CPU expert pool's products for bfloat16 experts, plain or q8_0 (strata/experts/native.py builds it on the host;
   measured by bench/cpu_experts.py against oneDNN): one window's experts in one OpenMP region of `threads` threads
   (gate_up products, silu(gate) * up rounded to bf16, down products), bf16 x bf16 dot products accumulated in float32
   (AVX512_BF16's vdpbf16ps). Each output (r, n) is summed in one fixed order whatever the rows beside it, so a row's
   bits do not depend on its neighbours.

   rows_R: y[r][n] = sum_k x[r][k] * w[n][k] for r < R, n in [n0, n1): x bf16 [R][ldx], w bf16 [N][K] (K a
   multiple of 32), y float32 [R][ldy]; J weight rows a step, R and J compile-time so the R x J accumulators stay
   in registers. q8_rows_R: the same over q8_0 records. */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ROWS(R, J)                                                                                              \
static void rows_##R(const uint16_t *x, int ldx, const uint16_t *w, float *y, int K, int ldy, int n0, int n1) { \
    int n = n0;                                                                                                 \
    for (; n + J <= n1; n += J) {                                                                               \
        __m512 acc[J][R];                                                                                       \
        for (int j = 0; j < J; j++) for (int r = 0; r < R; r++) acc[j][r] = _mm512_setzero_ps();                \
        const uint16_t *w0 = w + (size_t)n * K;                                                                 \
        for (int k = 0; k < K; k += 32) {                                                                       \
            __m512i wv[J];                                                                                      \
            for (int j = 0; j < J; j++) wv[j] = _mm512_loadu_si512((const void *)(w0 + (size_t)j * K + k));     \
            for (int r = 0; r < R; r++) {                                                                       \
                __m512i xv = _mm512_loadu_si512((const void *)(x + (size_t)r * ldx + k));                       \
                for (int j = 0; j < J; j++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], (__m512bh)xv, (__m512bh)wv[j]); \
            }                                                                                                   \
        }                                                                                                       \
        for (int j = 0; j < J; j++) for (int r = 0; r < R; r++)                                               \
            y[(size_t)r * ldy + n + j] = _mm512_reduce_add_ps(acc[j][r]);                                       \
    }                                                                                                           \
}
ROWS(1, 4) ROWS(2, 4) ROWS(3, 4) ROWS(4, 4) ROWS(5, 4) ROWS(6, 4) ROWS(7, 2) ROWS(8, 2)
typedef void (*rows_fn)(const uint16_t *, int, const uint16_t *, float *, int, int, int, int);
static const rows_fn ROWS_FN[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

/* The same products over q8_0 weight records (`strata.quant.packed`: a row's K int8 codes, then its K / 32 float16
   scales, padded; rows `rb` bytes apart): a step's 32 codes become 32 bf16 values exactly (int8 -> float32 ->
   bf16), their dot products with x are summed in float32 and scaled by the group's scale into the row's sum. The
   weights are read at 1.06 bytes a value instead of 2; a row's sum is its own (row-invariant as above). */
static inline __m512i q8_bf16(const int8_t *c) {
    __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)c));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w16)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w16, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  /* columns 0..15 from lo, 16..31 from hi */
}

#define ROWS_Q8(R, J)                                                                                           \
static void q8_rows_##R(const uint16_t *x, int ldx, const uint8_t *w, size_t rb, float *y, int K, int ldy,     \
                        int n0, int n1) {                                                                       \
    int n = n0;                                                                                                 \
    for (; n + J <= n1; n += J) {                                                                               \
        __m512 acc[J][R];                                                                                       \
        for (int j = 0; j < J; j++) for (int r = 0; r < R; r++) acc[j][r] = _mm512_setzero_ps();                \
        const uint8_t *w0 = w + (size_t)n * rb;                                                                 \
        for (int k = 0; k < K; k += 32) {                                                                       \
            __m512i wv[J];                                                                                      \
            __m512 sv[J];                                                                                       \
            for (int j = 0; j < J; j++) {                                                                       \
                const uint8_t *row = w0 + (size_t)j * rb;                                                       \
                wv[j] = q8_bf16((const int8_t *)(row + k));                                                     \
                uint16_t half; __builtin_memcpy(&half, row + K + (k / 32) * 2, 2);                              \
                sv[j] = _mm512_set1_ps(_cvtsh_ss(half));                                                        \
            }                                                                                                   \
            for (int r = 0; r < R; r++) {                                                                       \
                __m512i xv = _mm512_loadu_si512((const void *)(x + (size_t)r * ldx + k));                       \
                for (int j = 0; j < J; j++)                                                                     \
                    acc[j][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv,           \
                                                                 (__m512bh)wv[j]), sv[j], acc[j][r]);          \
            }                                                                                                   \
        }                                                                                                       \
        for (int j = 0; j < J; j++) for (int r = 0; r < R; r++)                                               \
            y[(size_t)r * ldy + n + j] = _mm512_reduce_add_ps(acc[j][r]);                                       \
    }                                                                                                           \
}
ROWS_Q8(1, 4) ROWS_Q8(2, 4) ROWS_Q8(3, 4) ROWS_Q8(4, 4) ROWS_Q8(5, 2) ROWS_Q8(6, 2) ROWS_Q8(7, 2) ROWS_Q8(8, 2)
typedef void (*q8_fn)(const uint16_t *, int, const uint8_t *, size_t, float *, int, int, int, int);
static const q8_fn Q8_FN[9] = {0, q8_rows_1, q8_rows_2, q8_rows_3, q8_rows_4, q8_rows_5, q8_rows_6, q8_rows_7,
                               q8_rows_8};


/* The work-sharing loops' schedule (`pool_schedule`): static shares (each thread its fixed part) or dynamic ones
   (units handed out as threads come free: a thread the OS preempted, beside the engine's own threads, delays no
   other). Results do not depend on it: every unit writes its own outputs in its own fixed order. */
static int sched_dynamic = 1, sched_chunk = 1;

int pool_schedule(int dynamic, int chunk) {
    sched_dynamic = dynamic != 0;
    sched_chunk = chunk > 0 ? chunk : 1;
    return 0;
}

static void set_schedule(void) {
    omp_set_schedule(sched_dynamic ? omp_sched_dynamic : omp_sched_static, sched_dynamic ? sched_chunk : 0);
}

/* AMX (where the CPU has it and Linux grants the tile state: `amx_enable`): a unit's 64 weight rows are four 16 x 32
   A tiles read straight from the plain weights, the rows' pairs (xv, `amx_pairs`) the B tile, four C tiles summing
   in float32; one tdpbf16ps covers 16 rows, so a window's rows cost no more weight reads than one. Each output is
   still summed in one fixed order whatever the rows beside it (its own A row and B column), but not in the
   AVX-512 path's order: a process uses one path throughout. */
static int use_amx = 0, amx_pf = 256;  /* amx_pf: weights prefetched this many columns ahead (0: none) */

/* Turns the AMX products on (asking Linux for the tile state first: -1 if refused) or off; `prefetch`: amx_pf. */
int amx_use(int on, int prefetch) {
    static int granted = 0;
    if (on && !granted) {
        if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return -1;
        granted = 1;
    }
    use_amx = on;
    amx_pf = prefetch;
    return 0;
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

static void amx_configure(void) {  /* per thread: 8 tiles of 16 rows x 64 bytes */
    tile_config cfg;
    __builtin_memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

/* R <= 16 rows of x (bf16, ld ldx) as the B operand: xv[kk][m] = the pair x[m][2kk], x[m][2kk + 1], zero for m >= R */
static void amx_pairs(const uint16_t *x, int ldx, int R, uint32_t *xv, int kk0, int kk1) {
    for (int kk = kk0; kk < kk1; kk++)
        for (int m = 0; m < 16; m++) {
            uint32_t v = 0;
            if (m < R) __builtin_memcpy(&v, x + (size_t)m * ldx + 2 * kk, 4);
            xv[(size_t)kk * 16 + m] = v;
        }
}

#define AMX_STORE(T)                                                                                            \
    do {                                                                                                        \
        _tile_stored(T, c, 64);                                                                                 \
        for (int n = 0; n < 16; n++) for (int m = 0; m < R; m++) y[(size_t)m * ldy + n0 + 16 * T + n] = c[n][m]; \
    } while (0)

/* y[m][n] = sum_k x[m][k] w[n][k] for m < R, n in [n0, n1) (a multiple of 16, at most 64 rows), x as its pairs xv */
static void amx_rows(const uint32_t *xv, int R, const uint16_t *w, int K, float *y, int ldy, int n0, int n1) {
    float c[16][16] __attribute__((aligned(64)));
    int tiles = (n1 - n0) / 16;
    size_t stride = (size_t)K * 2;
    const uint16_t *w0 = w + (size_t)n0 * K;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        if (amx_pf && k + amx_pf < K)
            for (int n = 0; n < 16 * tiles; n++) _mm_prefetch((const char *)(w0 + (size_t)n * K + k + amx_pf), _MM_HINT_T0);
        _tile_loadd(6, xv + (size_t)k / 2 * 16, 64);
        _tile_loadd(4, w0 + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (tiles > 1) { _tile_loadd(5, w0 + 16 * (size_t)K + k, stride); _tile_dpbf16ps(1, 5, 6); }
        if (tiles > 2) { _tile_loadd(7, w0 + 32 * (size_t)K + k, stride); _tile_dpbf16ps(2, 7, 6); }
        if (tiles > 3) { _tile_loadd(4, w0 + 48 * (size_t)K + k, stride); _tile_dpbf16ps(3, 4, 6); }
    }
    AMX_STORE(0);
    if (tiles > 1) AMX_STORE(1);
    if (tiles > 2) AMX_STORE(2);
    if (tiles > 3) AMX_STORE(3);
}

#define BLOCK 64  /* weight rows a work unit */
#define SUM_BLOCK 256  /* outputs a unit of the weighted sums */

/* Inside experts_run's parallel region: y [P][N] = each expert's rows of src [P][K] through its weights w[e] [N][K],
   on AMX: each group of 16 rows (group[e] .. group[e + 1] - 1 are expert e's) turned into its pairs in xv, then the
   products, a unit of BLOCK weight rows at a time. */
static void amx_products(int E, const int *group, const int *start, const int *count, const uint16_t *src, int K,
                         uint32_t *xv, const int64_t *w, int N, float *y) {
    int nb = (N + BLOCK - 1) / BLOCK;
    #pragma omp for schedule(runtime)
    for (int u = 0; u < E * 16; u++) {  /* expert, sixteenth of the pairs */
        int e = u / 16, c = u % 16;
        for (int g = group[e]; g < group[e + 1]; g++) {
            int r0 = (g - group[e]) * 16, R16 = count[e] - r0 < 16 ? count[e] - r0 : 16;
            amx_pairs(src + (size_t)(start[e] + r0) * K, K, R16, xv + (size_t)g * K * 8, c * K / 32, (c + 1) * K / 32);
        }
    }
    #pragma omp for schedule(runtime)
    for (int u = 0; u < E * nb; u++) {
        int e = u / nb, b = u % nb, n1 = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
        for (int g = group[e]; g < group[e + 1]; g++) {
            int r0 = (g - group[e]) * 16, R16 = count[e] - r0 < 16 ? count[e] - r0 : 16;
            amx_rows(xv + (size_t)g * K * 8, R16, (const uint16_t *)w[e], K, y + (size_t)(start[e] + r0) * N, N,
                     b * BLOCK, n1);
        }
    }
}

/* E experts: expert e's rows are x[start[e] .. start[e] + count[e]) (bf16 [P][H]), or with `gather` the rows
   x[gather[start[e]]], ...; its gate_up bf16 [2I][H] at address gate_up[e], its down bf16 [H][I] at down[e].
   Scratch xg bf16 [P][H] (with gather), h float32 [P][2I], a bf16 [P][I]; out float32 [P][H]. With `sum` (R rows):
   sum[r] = the weighted outputs of row r's pairs, pw[q] * out[q] for q = pairs[first[r]] .. pairs[first[r + 1] - 1]
   added in that order (zeros for a row with none). With `phases` (4 entries), seconds added: [0] from
   the region's start until its last thread came in (the threads' wake-up), [1] the gather and gate_up products,
   [2] silu and the down products, [3] the sums. */
static void experts_run(int E, const int64_t *gate_up, const int64_t *down, const int *start, const int *count,
                        const uint16_t *x, const int *gather, uint16_t *xg, float *h, uint16_t *a, float *out,
                        int H, int I, int threads, int q8, size_t rb1, size_t rb2,
                        int R, const int *first, const int *pairs, const float *pw, float *sum, double *phases) {
    int nb1 = (2 * I + BLOCK - 1) / BLOCK, nb2 = (H + BLOCK - 1) / BLOCK, P = start[E - 1] + count[E - 1];
    const uint16_t *rows = gather ? xg : x;
    int amx = use_amx && !q8, G = 0;  /* AMX: each expert's rows in groups of 16, each group's pairs in xv1 / xv2 */
    int *group = 0;
    uint32_t *xv = 0;
    if (amx) {
        group = malloc(sizeof(int) * (E + 1));
        for (int e = 0; e < E; e++) { group[e] = G; G += (count[e] + 15) / 16; }
        group[E] = G;
        xv = malloc((size_t)G * (H > I ? H : I) * 32);  /* K / 2 pairs x 16 rows x 4 bytes a group */
    }
    set_schedule();  /* inherited by the region's threads from this one */
    double t0 = phases ? omp_get_wtime() : 0.0, came = t0, t1 = 0.0, t2 = 0.0, t3 = 0.0;
    #pragma omp parallel num_threads(threads)
    {
        if (phases) {
            double in = omp_get_wtime();
            #pragma omp critical(strata_pool_phases)
            came = in > came ? in : came;
        }
        if (amx) amx_configure();
        if (gather) {
            #pragma omp for schedule(runtime)
            for (int p = 0; p < P; p++) __builtin_memcpy(xg + (size_t)p * H, x + (size_t)gather[p] * H, 2 * (size_t)H);
        }
        if (amx)
            amx_products(E, group, start, count, rows, H, xv, gate_up, 2 * I, h);
        else
        #pragma omp for schedule(runtime)
        for (int u = 0; u < E * nb1; u++) {
            int e = u / nb1, b = u % nb1, n1 = (b + 1) * BLOCK < 2 * I ? (b + 1) * BLOCK : 2 * I;
            for (int r0 = 0; r0 < count[e]; r0 += 8) {
                int R8 = count[e] - r0 < 8 ? count[e] - r0 : 8;
                if (q8)
                    Q8_FN[R8](rows + (size_t)(start[e] + r0) * H, H, (const uint8_t *)gate_up[e], rb1,
                              h + (size_t)(start[e] + r0) * 2 * I, H, 2 * I, b * BLOCK, n1);
                else
                    ROWS_FN[R8](rows + (size_t)(start[e] + r0) * H, H, (const uint16_t *)gate_up[e],
                                h + (size_t)(start[e] + r0) * 2 * I, H, 2 * I, b * BLOCK, n1);
            }
        }
        #pragma omp master
        t1 = phases ? omp_get_wtime() : 0.0;  /* after the products' loop and its barrier */
        #pragma omp for schedule(runtime)
        for (int p = 0; p < P; p++) {
            float *hp = h + (size_t)p * 2 * I;
            for (int i = 0; i < I; i++) {
                float g = hp[i], v = g / (1.0f + expf(-g)) * hp[I + i];
                uint32_t bits; __builtin_memcpy(&bits, &v, 4);
                bits += 0x7fff + ((bits >> 16) & 1);  /* round to nearest even */
                a[(size_t)p * I + i] = (uint16_t)(bits >> 16);
            }
        }
        if (amx)
            amx_products(E, group, start, count, a, I, xv, down, H, out);
        else
        #pragma omp for schedule(runtime)
        for (int u = 0; u < E * nb2; u++) {
            int e = u / nb2, b = u % nb2, n1 = (b + 1) * BLOCK < H ? (b + 1) * BLOCK : H;
            for (int r0 = 0; r0 < count[e]; r0 += 8) {
                int R8 = count[e] - r0 < 8 ? count[e] - r0 : 8;
                if (q8)
                    Q8_FN[R8](a + (size_t)(start[e] + r0) * I, I, (const uint8_t *)down[e], rb2,
                              out + (size_t)(start[e] + r0) * H, I, H, b * BLOCK, n1);
                else
                    ROWS_FN[R8](a + (size_t)(start[e] + r0) * I, I, (const uint16_t *)down[e],
                                out + (size_t)(start[e] + r0) * H, I, H, b * BLOCK, n1);
            }
        }
        #pragma omp master
        t2 = phases ? omp_get_wtime() : 0.0;
        if (sum) {
            int nbs = (H + SUM_BLOCK - 1) / SUM_BLOCK;
            #pragma omp for schedule(runtime)
            for (int u = 0; u < R * nbs; u++) {
                int r = u / nbs, h0 = u % nbs * SUM_BLOCK, h1 = h0 + SUM_BLOCK < H ? h0 + SUM_BLOCK : H;
                float *dst = sum + (size_t)r * H;
                if (first[r] == first[r + 1]) {
                    for (int j = h0; j < h1; j++) dst[j] = 0.0f;
                    continue;
                }
                for (int q = first[r]; q < first[r + 1]; q++) {
                    const float *src = out + (size_t)pairs[q] * H;
                    float w = pw[pairs[q]];
                    if (q == first[r])
                        for (int j = h0; j < h1; j++) dst[j] = src[j] * w;
                    else
                        for (int j = h0; j < h1; j++) dst[j] = dst[j] + src[j] * w;  /* -ffp-contract=off: no fma */
                }
            }
        }
        if (amx) _tile_release();
    }
    if (phases) {
        t3 = omp_get_wtime();
        phases[0] += came - t0; phases[1] += t1 - came; phases[2] += t2 - t1; phases[3] += t3 - t2;
    }
    free(group); free(xv);
}

void experts_bf16(int E, const int64_t *gate_up, const int64_t *down, const int *start, const int *count,
                  const uint16_t *x, float *h, uint16_t *a, float *out, int H, int I, int threads) {
    experts_run(E, gate_up, down, start, count, x, 0, 0, h, a, out, H, I, threads, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

/* `experts_bf16` over q8_0 records: gate_up[e] [2I] rows of rb1 bytes (K = H), down[e] [H] rows of rb2 (K = I). */
void experts_q8_0(int E, const int64_t *gate_up, const int64_t *down, const int *start, const int *count,
                  const uint16_t *x, float *h, uint16_t *a, float *out, int H, int I, int threads, int rb1, int rb2) {
    experts_run(E, gate_up, down, start, count, x, 0, 0, h, a, out, H, I, threads, 1, rb1, rb2, 0, 0, 0, 0, 0, 0);
}

/* One window of a pool (`strata.experts.pool.ExpertPool`) in one call: the R x k routed pairs (global expert ids
   `ids`, int64 or int32, and their routing weights `wts`, float32 or bf16) counted per expert into counts[N]; the
   pairs whose host slot (index[id], N entries) lies in [lo, hi) grouped by slot, ascending, each slot's pairs in
   row order; their experts run (slot s's weights at gate_up_base + (s - lo) * gate_up_stride bytes, down alike;
   q8: records of rb1 / rb2 bytes a row); and sum[r] [H] float32 = row r's weighted outputs added in slot order.
   stats[0] += the pairs computed, stats[1] += the experts read; phases[0] += the seconds of this bookkeeping before
   the products, phases[1 ..] as experts_run's. Returns 0, or -1 for an id outside [0, N). */
int pool_window(int R, int k, const void *ids, int ids64, const void *wts, int wts_bf16, const int64_t *index,
                int N, int64_t lo, int64_t hi, double *counts, int64_t gate_up_base, int64_t gate_up_stride,
                int64_t down_base, int64_t down_stride, const uint16_t *x, float *sum, int H, int I, int threads,
                int q8, int rb1, int rb2, int64_t *stats, double *phases) {
    double t0 = omp_get_wtime();
    int n = R * k, P = 0, E = 0, nslot = (int)(hi - lo);
    int *slot = malloc(sizeof(int) * (size_t)(n + 1)), *at = calloc((size_t)nslot + 1, sizeof(int));
    for (int p = 0; p < n; p++) {
        int64_t g = ids64 ? ((const int64_t *)ids)[p] : ((const int32_t *)ids)[p];
        if (g < 0 || g >= N) { free(slot); free(at); return -1; }
        counts[g] += 1.0;
        int64_t s = index[g];
        slot[p] = s >= lo && s < hi ? (int)(s - lo) : -1;
        if (slot[p] >= 0) { P++; if (at[slot[p] + 1]++ == 0) E++; }
    }
    if (!P) {
        for (size_t j = 0; j < (size_t)R * H; j++) sum[j] = 0.0f;
        free(slot); free(at);
        return 0;
    }
    int *start = malloc(sizeof(int) * E), *count = malloc(sizeof(int) * E), *order = malloc(sizeof(int) * P);
    int64_t *gu = malloc(sizeof(int64_t) * E), *dn = malloc(sizeof(int64_t) * E);
    for (int s = 0, e = 0; s < nslot; s++) {
        if (at[s + 1]) {
            start[e] = at[s]; count[e] = at[s + 1];
            gu[e] = gate_up_base + (int64_t)s * gate_up_stride; dn[e] = down_base + (int64_t)s * down_stride;
            e++;
        }
        at[s + 1] += at[s];  /* at[s]: where slot s's pairs begin */
    }
    for (int p = 0; p < n; p++)
        if (slot[p] >= 0) order[at[slot[p]]++] = p;  /* pair ids, grouped by slot, ascending within one */
    int *gather = malloc(sizeof(int) * P), *first = calloc((size_t)R + 1, sizeof(int)), *pairs = malloc(sizeof(int) * P);
    float *pw = malloc(sizeof(float) * P);
    for (int q = 0; q < P; q++) {
        int p = order[q];
        gather[q] = p / k;
        first[p / k + 1]++;
        if (wts_bf16) {
            uint32_t bits = (uint32_t)((const uint16_t *)wts)[p] << 16;
            __builtin_memcpy(&pw[q], &bits, 4);
        } else
            pw[q] = ((const float *)wts)[p];
    }
    for (int r = 0; r < R; r++) first[r + 1] += first[r];
    int *fill = malloc(sizeof(int) * (R + 1));
    __builtin_memcpy(fill, first, sizeof(int) * (R + 1));
    for (int q = 0; q < P; q++) pairs[fill[gather[q]]++] = q;  /* each row's pairs in slot order */
    uint16_t *xg = malloc(2 * (size_t)P * H), *a = malloc(2 * (size_t)P * I);
    float *h = malloc(4 * (size_t)P * 2 * I), *out = malloc(4 * (size_t)P * H);
    phases[0] += omp_get_wtime() - t0;
    experts_run(E, gu, dn, start, count, x, gather, xg, h, a, out, H, I, threads, q8, (size_t)rb1, (size_t)rb2,
                R, first, pairs, pw, sum, phases + 1);
    stats[0] += P;
    stats[1] += E;
    free(slot); free(at); free(start); free(count); free(order); free(gu); free(dn); free(gather); free(first);
    free(pairs); free(pw); free(fill); free(xg); free(a); free(h); free(out);
    return 0;
}
