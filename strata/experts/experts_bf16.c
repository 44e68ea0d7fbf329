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

#define BLOCK 64  /* weight rows a work unit */

/* E experts: expert e's rows are x[start[e] .. start[e] + count[e]) (bf16 [P][H]); its gate_up bf16 [2I][H] at
   address gate_up[e], its down bf16 [H][I] at down[e]. Scratch h float32 [P][2I], a bf16 [P][I]; out float32 [P][H]. */
static void experts_run(int E, const int64_t *gate_up, const int64_t *down, const int *start, const int *count,
                        const uint16_t *x, float *h, uint16_t *a, float *out, int H, int I, int threads, int q8,
                        size_t rb1, size_t rb2) {
    int nb1 = (2 * I + BLOCK - 1) / BLOCK, nb2 = (H + BLOCK - 1) / BLOCK;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int u = 0; u < E * nb1; u++) {
            int e = u / nb1, b = u % nb1, n1 = (b + 1) * BLOCK < 2 * I ? (b + 1) * BLOCK : 2 * I;
            for (int r0 = 0; r0 < count[e]; r0 += 8) {
                int R = count[e] - r0 < 8 ? count[e] - r0 : 8;
                if (q8)
                    Q8_FN[R](x + (size_t)(start[e] + r0) * H, H, (const uint8_t *)gate_up[e], rb1,
                             h + (size_t)(start[e] + r0) * 2 * I, H, 2 * I, b * BLOCK, n1);
                else
                    ROWS_FN[R](x + (size_t)(start[e] + r0) * H, H, (const uint16_t *)gate_up[e],
                               h + (size_t)(start[e] + r0) * 2 * I, H, 2 * I, b * BLOCK, n1);
            }
        }
        int P = start[E - 1] + count[E - 1];
        #pragma omp for schedule(static)
        for (int p = 0; p < P; p++) {
            float *hp = h + (size_t)p * 2 * I;
            for (int i = 0; i < I; i++) {
                float g = hp[i], v = g / (1.0f + expf(-g)) * hp[I + i];
                uint32_t bits; __builtin_memcpy(&bits, &v, 4);
                bits += 0x7fff + ((bits >> 16) & 1);  /* round to nearest even */
                a[(size_t)p * I + i] = (uint16_t)(bits >> 16);
            }
        }
        #pragma omp for schedule(static)
        for (int u = 0; u < E * nb2; u++) {
            int e = u / nb2, b = u % nb2, n1 = (b + 1) * BLOCK < H ? (b + 1) * BLOCK : H;
            for (int r0 = 0; r0 < count[e]; r0 += 8) {
                int R = count[e] - r0 < 8 ? count[e] - r0 : 8;
                if (q8)
                    Q8_FN[R](a + (size_t)(start[e] + r0) * I, I, (const uint8_t *)down[e], rb2,
                             out + (size_t)(start[e] + r0) * H, I, H, b * BLOCK, n1);
                else
                    ROWS_FN[R](a + (size_t)(start[e] + r0) * I, I, (const uint16_t *)down[e],
                               out + (size_t)(start[e] + r0) * H, I, H, b * BLOCK, n1);
            }
        }
    }
}

void experts_bf16(int E, const int64_t *gate_up, const int64_t *down, const int *start, const int *count,
                  const uint16_t *x, float *h, uint16_t *a, float *out, int H, int I, int threads) {
    experts_run(E, gate_up, down, start, count, x, h, a, out, H, I, threads, 0, 0, 0);
}

/* `experts_bf16` over q8_0 records: gate_up[e] [2I] rows of rb1 bytes (K = H), down[e] [H] rows of rb2 (K = I). */
void experts_q8_0(int E, const int64_t *gate_up, const int64_t *down, const int *start, const int *count,
                  const uint16_t *x, float *h, uint16_t *a, float *out, int H, int I, int threads, int rb1, int rb2) {
    experts_run(E, gate_up, down, start, count, x, h, a, out, H, I, threads, 1, rb1, rb2);
}
