/* Products over packed weights on the CPU (strata/kernels/cpu_packed.py builds and calls it): y = x @ W.T for x
   float32 [R][K] and W kept as the row records of `strata.quant.packed` (q8_0, q4_1, q4_k, q6_k). Built for AVX2 +
   FMA + F16C; where the CPU has AVX-512 the same products run 16 lanes wide (`cpu_packed_wide`): half the
   instructions a block, 1.2 to 1.4 times the rate measured on 2 cores of an AMD EPYC (bench/cpu_packed.py).

   A weight row's 32 columns at a time become float codes in registers (four 8-lane or two 16-lane vectors) and are
   multiplied with each row of x in turn. The scales come out of the sums: a row's output is
       sum over blocks b of  scale_b * (sum of x * code over b's 32 columns)   (q6_k: scale per 16 columns)
     + sum over blocks b of  min_b * (sum of x over b's columns)               (q4_1: m; q4_k: -dmin * min)
   where the codes are small integers (exact in float32). 4-bit codes are decoded in the order their bytes hold
   them, not column order; x is permuted to match once per call (`column`), which costs nothing per weight row.

   Row invariance: every output (r, n) is summed in one fixed order (per block: a product then multiply-adds in the
   vector's lanes, then one multiply-add into the row's sum, 16 lanes: its even or odd blocks' sum; the lanes added
   in one fixed tree at the end, then the mins' share), whatever R is, whatever the other rows hold, and however
   the weight rows are shared among threads (threads take whole weight rows, never parts of K). The rows of x are
   taken up to 8 at a time against one decoded block: that changes which sums are in registers together, not the
   operations of any one of them. Each width has its own order, so a process keeps one; the build has
   -ffp-contract=off: no multiply-add the source does not write. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

enum { Q8_0 = 0, Q4_1 = 1, Q4_K = 2, Q6_K = 3 };
#define ROWS 8          /* rows of x against one decoded block */
#define CHUNK 16        /* weight rows a thread takes at a time */
#define PREFETCH 16384  /* bytes of weight records asked for ahead of the row being read (about twice the rate) */
#define WIDE __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))

static const int WORD_ORDER[8] = {0, 4, 2, 6, 1, 5, 3, 7};  /* field i of a q4_k / q6_k word holds this column */
static int wide = -1;  /* 16 lanes (AVX-512) or 8; -1: not chosen yet (the widest the CPU has) */

/* Use 16-lane products from now on (on) or 8-lane ones; returns the width in use (16 or 8). on < 0: the widest
   this CPU has. */
int cpu_packed_wide(int on) {
    __builtin_cpu_init();
    int can = __builtin_cpu_supports("avx512f") != 0;  /* the CPU's and the OS's (its registers saved) */
    wide = on < 0 ? can : on && can;
    return wide ? 16 : 8;
}

static inline int has_mins(int fmt) { return fmt == Q4_1 || fmt == Q4_K; }
static inline int scales_per_block(int fmt) { return fmt == Q6_K ? 2 : 1; }

/* The column of a 32-column block that position p of the decoded vectors (`lanes` each) holds. 8 lanes: vector
   p / 8 holds the low (even vectors) or high nibbles of bytes 0..7 (vectors 0, 1) or 8..15 (vectors 2, 3); 16
   lanes: the low (vector 0) or high nibbles of bytes 0..15. */
static int column(int fmt, int lanes, int p) {
    int v = p / lanes, lane = p % lanes, byte = lanes == 8 ? (v / 2) * 8 + lane : lane, high = v % 2;
    if (fmt == Q8_0)
        return p;
    if (fmt == Q4_1)
        return 2 * byte + high;
    return 8 * (byte / 4) + WORD_ORDER[2 * (byte % 4) + high];  /* word order */
}

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

WIDE INLINE float hsum16(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* Block b's 32 codes of the record `rec` as float vectors c[0..3] (q6_k: code - 32). */
INLINE void decode(const int fmt, const uint8_t *rec, int K, int b, __m256 c[4]) {
    if (fmt == Q8_0) {
        const uint8_t *q = rec + (size_t)b * 32;
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
        return;
    }
    const uint8_t *q = rec + (size_t)b * 16;
    const __m256i low = _mm256_set1_epi32(15);
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i v[4] = {_mm256_and_si256(lo, low), _mm256_srli_epi32(lo, 4), _mm256_and_si256(hi, low),
                    _mm256_srli_epi32(hi, 4)};
    if (fmt == Q6_K) {  /* the top two bits: 16 a word of 8 columns, field f at bits 2f, 2f + 1 */
        const uint8_t *h = rec + K / 2 + (size_t)b * 8;
        const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), two = _mm256_set1_epi32(2);
        const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
        for (int i = 0; i < 4; i++) {
            uint32_t word;
            memcpy(&word, h + 4 * (i / 2), 4);
            __m256i s = i % 2 ? _mm256_add_epi32(shift, two) : shift;
            __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), s), three);
            v[i] = _mm256_sub_epi32(_mm256_or_si256(v[i], _mm256_slli_epi32(top, 4)), bias);
        }
    }
    for (int i = 0; i < 4; i++)
        c[i] = _mm256_cvtepi32_ps(v[i]);
}

/* The same 16 lanes wide: c[0..1]. */
WIDE INLINE void decode16(const int fmt, const uint8_t *rec, int K, int b, __m512 c[2]) {
    if (fmt == Q8_0) {
        const uint8_t *q = rec + (size_t)b * 32;
        for (int i = 0; i < 2; i++)
            c[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i))));
        return;
    }
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rec + (size_t)b * 16)));
    __m512i v[2] = {_mm512_and_si512(bytes, _mm512_set1_epi32(15)), _mm512_srli_epi32(bytes, 4)};
    if (fmt == Q6_K) {  /* lanes 0..7: the top bits' words 0, 1 (bits 0..31 of the block's 8 bytes); 8..15: 2, 3 */
        __m128i h = _mm_loadl_epi64((const __m128i *)(rec + K / 2 + (size_t)b * 8));
        __m512i words = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                 _mm512_castsi128_si512(h));
        const __m512i shift = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        for (int i = 0; i < 2; i++) {
            __m512i s = i ? _mm512_add_epi32(shift, _mm512_set1_epi32(2)) : shift;
            __m512i top = _mm512_and_si512(_mm512_srlv_epi32(words, s), _mm512_set1_epi32(3));
            v[i] = _mm512_sub_epi32(_mm512_or_si512(v[i], _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32));
        }
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_cvtepi32_ps(v[i]);
}

/* A weight row's scales (and mins) as floats: scale[K/32] (q6_k: [K/16]) and min[K/32] padded with zeros to a
   multiple of 8 (`nbp`). Each is the product the dequantizer forms, exact in float32; 8 at a time. */
static void row_scales(int fmt, const uint8_t *rec, int K, float *scale, float *min, int nbp) {
    int nb = K / 32, b = 0;
    if (fmt == Q8_0) {
        for (; b + 8 <= nb; b += 8)
            _mm256_storeu_ps(scale + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + K + 2 * b))));
        for (; b < nb; b++)
            scale[b] = half(rec + K + 2 * b);
    } else if (fmt == Q4_1) {  /* (d, m) pairs */
        const uint8_t *dm = rec + K / 2;
        for (; b + 8 <= nb; b += 8) {
            __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 4 * b)));
            __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + 4 * b + 16)));
            __m256d d = _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88));  /* d0 d1 d4 d5 | d2 d3 d6 d7 */
            __m256d m = _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd));
            _mm256_storeu_ps(scale + b, _mm256_castpd_ps(_mm256_permute4x64_pd(d, 0xd8)));
            _mm256_storeu_ps(min + b, _mm256_castpd_ps(_mm256_permute4x64_pd(m, 0xd8)));
        }
        for (; b < nb; b++) {
            scale[b] = half(dm + 4 * b);
            min[b] = half(dm + 4 * b + 2);
        }
    } else if (fmt == Q4_K) {  /* a super-block's (d, dmin), then its 8 blocks' (scale, min) bytes */
        const uint8_t *supers = rec + K / 2, *sm = supers + K / 256 * 4;
        const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        for (; b < nb; b += 8) {
            __m256 d = _mm256_set1_ps(half(supers + 4 * (b / 8)));
            __m256 dmin = _mm256_set1_ps(half(supers + 4 * (b / 8) + 2));
            __m128i pairs = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(sm + 2 * b)), split);
            __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pairs));
            __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(pairs, 8)));
            _mm256_storeu_ps(scale + b, _mm256_mul_ps(d, sc));
            _mm256_storeu_ps(min + b, _mm256_xor_ps(_mm256_mul_ps(dmin, mn), _mm256_set1_ps(-0.0f)));  /* -() */
        }
    } else {  /* q6_k: a super-block's d, its 16 groups' int8 scales */
        const uint8_t *supers = rec + K / 2 + K / 4;
        const int8_t *sc = (const int8_t *)(supers + K / 256 * 2);
        for (int g = 0; g < K / 16; g += 8) {
            __m256 d = _mm256_set1_ps(half(supers + 2 * (g / 16)));
            __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + g))));
            _mm256_storeu_ps(scale + g, _mm256_mul_ps(d, s));
        }
    }
    if (has_mins(fmt))
        for (b = nb; b < nbp; b++)
            min[b] = 0.0f;
}

/* The mins' share of row r's output: sum over blocks of min_b * (the block's sum of x). */
INLINE float mins(const float *min, const float *xs, int nbp) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < nbp; i += 8)
        m = _mm256_fmadd_ps(_mm256_loadu_ps(min + i), _mm256_loadu_ps(xs + i), m);
    return hsum(m);
}

/* y[r * ldy] for rows r < RB of xp (permuted x, rows ldx apart) over one weight record, 8 lanes. */
INLINE void tile8(const int fmt, const int RB, const float *xp, size_t ldx, const float *xs, int nbp,
                  const uint8_t *rec, int K, const float *scale, const float *min, float bias, float *y, size_t ldy) {
    __m256 acc[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
        acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        __m256 c[4];
        decode(fmt, rec, K, b, c);
        if (fmt == Q6_K) {
            __m256 s0 = _mm256_broadcast_ss(scale + 2 * b), s1 = _mm256_broadcast_ss(scale + 2 * b + 1);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const float *x = xp + r * ldx + (size_t)b * 32;
                __m256 t0 = _mm256_mul_ps(c[0], _mm256_loadu_ps(x));
                t0 = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(x + 8), t0);
                __m256 t1 = _mm256_mul_ps(c[2], _mm256_loadu_ps(x + 16));
                t1 = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(x + 24), t1);
                acc[r] = _mm256_fmadd_ps(t0, s0, acc[r]);
                acc[r] = _mm256_fmadd_ps(t1, s1, acc[r]);
            }
        } else {
            __m256 s = _mm256_broadcast_ss(scale + b);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const float *x = xp + r * ldx + (size_t)b * 32;
                __m256 t = _mm256_mul_ps(c[0], _mm256_loadu_ps(x));
                t = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(x + 8), t);
                t = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(x + 16), t);
                t = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(x + 24), t);
                acc[r] = _mm256_fmadd_ps(t, s, acc[r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        float v = hsum(acc[r]);
        if (has_mins(fmt))
            v = v + mins(min, xs + r * (size_t)nbp, nbp);
        y[r * ldy] = v + bias;
    }
}

/* Block b's share of rows r < RB, 16 lanes wide, into acc (q6_k: lanes 0..7 of a block's vectors are its first 16
   columns, 8..15 its second). */
WIDE INLINE void block16(const int fmt, const int RB, const float *xp, size_t ldx, const uint8_t *rec, int K,
                         const float *scale, int b, __m512 *acc) {
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 c[2], s;
    decode16(fmt, rec, K, b, c);
    if (fmt == Q6_K)
        s = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_castpd128_pd512(
                _mm_load_sd((const double *)(scale + 2 * b)))));
    else
        s = _mm512_set1_ps(scale[b]);
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        const float *x = xp + r * ldx + (size_t)b * 32;
        __m512 t = _mm512_mul_ps(c[0], _mm512_loadu_ps(x));
        t = _mm512_fmadd_ps(c[1], _mm512_loadu_ps(x + 16), t);
        acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
    }
}

/* The same as tile8 16 lanes wide, with two sums a row (even and odd blocks: a multiply-add's latency, not its
   rate, would bound one row's pass), added at the end. */
WIDE INLINE void tile16(const int fmt, const int RB, const float *xp, size_t ldx, const float *xs, int nbp,
                        const uint8_t *rec, int K, const float *scale, const float *min, float bias, float *y,
                        size_t ldy) {
    __m512 even[ROWS], odd[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
        even[r] = odd[r] = _mm512_setzero_ps();
    int nb = K / 32, b = 0;
    for (; b + 2 <= nb; b += 2) {
        block16(fmt, RB, xp, ldx, rec, K, scale, b, even);
        block16(fmt, RB, xp, ldx, rec, K, scale, b + 1, odd);
    }
    if (b < nb)
        block16(fmt, RB, xp, ldx, rec, K, scale, b, even);
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) {
        float v = hsum16(_mm512_add_ps(even[r], odd[r]));
        if (has_mins(fmt))
            v = v + mins(min, xs + r * (size_t)nbp, nbp);
        y[r * ldy] = v + bias;
    }
}

typedef void (*tile_fn)(const float *, size_t, const float *, int, const uint8_t *, int, const float *,
                        const float *, float, float *, size_t);
#define TILE(W, F, RB)                                                                                          \
    static ATTR##W void tile##W##_##F##_##RB(const float *xp, size_t ldx, const float *xs, int nbp,           \
                                              const uint8_t *rec, int K, const float *scale, const float *min,  \
                                              float bias, float *y, size_t ldy) {                               \
        tile##W(F, RB, xp, ldx, xs, nbp, rec, K, scale, min, bias, y, ldy);                                    \
    }
#define TILES(W, F) TILE(W, F, 1) TILE(W, F, 2) TILE(W, F, 3) TILE(W, F, 4) TILE(W, F, 5) TILE(W, F, 6)        \
                    TILE(W, F, 7) TILE(W, F, 8)
#define FNS(W, F) {0, tile##W##_##F##_1, tile##W##_##F##_2, tile##W##_##F##_3, tile##W##_##F##_4,               \
                   tile##W##_##F##_5, tile##W##_##F##_6, tile##W##_##F##_7, tile##W##_##F##_8}
#define ATTR8
#define ATTR16 WIDE
TILES(8, Q8_0) TILES(8, Q4_1) TILES(8, Q4_K) TILES(8, Q6_K)
TILES(16, Q8_0) TILES(16, Q4_1) TILES(16, Q4_K) TILES(16, Q6_K)
static const tile_fn TILE_FN[2][4][ROWS + 1] = {
    {FNS(8, Q8_0), FNS(8, Q4_1), FNS(8, Q4_K), FNS(8, Q6_K)},
    {FNS(16, Q8_0), FNS(16, Q4_1), FNS(16, Q4_K), FNS(16, Q6_K)}};

/* y [R][N] = x [R][K] @ W.T (+ bias [N] where not NULL); W: N records of `rb` bytes in format `fmt`, K a multiple
   of 32 (q4_k, q6_k: of 256). Returns 0, or -1 where memory could not be had. */
int cpu_packed_linear(int fmt, const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t N, int64_t rb,
                      const float *bias, float *y, int threads) {
    if (wide < 0)
        cpu_packed_wide(-1);
    int lanes = wide ? 16 : 8, nb = (int)(K / 32), nbp = (nb + 7) / 8 * 8, ns = nb * scales_per_block(fmt);
    float *xp = malloc(sizeof(float) * (size_t)(R * K)), *xs = calloc((size_t)(R * nbp), sizeof(float));
    if (!xp || !xs) {
        free(xp);
        free(xs);
        return -1;
    }
    int perm[32];
    for (int p = 0; p < 32; p++)
        perm[p] = column(fmt, lanes, p);
    for (int64_t r = 0; r < R; r++)
        for (int b = 0; b < nb; b++) {
            float *p = xp + r * K + b * 32;
            for (int i = 0; i < 32; i++)
                p[i] = x[r * K + b * 32 + perm[i]];
            if (has_mins(fmt)) {  /* each block's sum of x, in one fixed order */
                __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
                xs[r * nbp + b] = hsum(s);
            }
        }
    const tile_fn *fns = TILE_FN[wide][fmt];
    int failed = 0;
    int64_t chunks = (N + CHUNK - 1) / CHUNK, end = N * rb;
#pragma omp parallel num_threads(threads)
    {
        float *scale = malloc(sizeof(float) * (size_t)CHUNK * ns), *min = malloc(sizeof(float) * (size_t)CHUNK * nbp);
        if (!scale || !min) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!scale || !min)
                continue;
            int64_t n0 = c * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            for (int64_t n = n0; n < n1; n++)
                row_scales(fmt, w + n * rb, (int)K, scale + (n - n0) * ns, min + (n - n0) * nbp, nbp);
            for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
                tile_fn f = fns[R - r0 < ROWS ? R - r0 : ROWS];
                for (int64_t n = n0; n < n1; n++) {
                    if (r0 == 0) {  /* the next rows' bytes on their way while this one is read */
                        int64_t from = n * rb + PREFETCH, to = from + rb < end ? from + rb : end;
                        for (int64_t o = from & ~(int64_t)63; o < to; o += 64)
                            _mm_prefetch((const char *)w + o, _MM_HINT_T0);
                    }
                    f(xp + r0 * K, (size_t)K, xs + r0 * nbp, nbp, w + n * rb, (int)K, scale + (n - n0) * ns,
                      min + (n - n0) * nbp, bias ? bias[n] : 0.0f, y + r0 * N + n, (size_t)N);
                }
            }
        }
        free(scale);
        free(min);
    }
    free(xp);
    free(xs);
    return failed ? -1 : 0;
}

/* out [N][K] float32: each weight as `strata.quant.packed.dequantize` forms it (the same operations in the same
   order, so the same bits). Returns 0, or -1 where memory could not be had. */
int cpu_packed_dequantize(int fmt, const uint8_t *w, int64_t N, int64_t K, int64_t rb, float *out, int threads) {
    int nb = (int)(K / 32), nbp = (nb + 7) / 8 * 8, perm[32], failed = 0;
    for (int p = 0; p < 32; p++)
        perm[p] = column(fmt, 8, p);
#pragma omp parallel num_threads(threads)
    {
        float *scale = malloc(sizeof(float) * (size_t)(2 * nb)), *min = malloc(sizeof(float) * (size_t)nbp);
        if (!scale || !min) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *rec = w + n * rb;
            float *o = out + n * K;
            if (fmt == Q8_0) {
                const int8_t *q = (const int8_t *)rec;
                for (int64_t b = 0; b < K / 32; b++) {
                    float s = half(rec + K + 2 * b);
                    for (int i = 0; i < 32; i++)
                        o[b * 32 + i] = s * (float)q[b * 32 + i];
                }
            } else if (fmt == Q4_1) {
                for (int64_t b = 0; b < K / 32; b++) {
                    float d = half(rec + K / 2 + 4 * b), m = half(rec + K / 2 + 4 * b + 2);
                    for (int j = 0; j < 16; j++) {
                        uint8_t q = rec[b * 16 + j];
                        float lo = d * (float)(q & 15), hi = d * (float)(q >> 4);
                        o[b * 32 + 2 * j] = lo + m;
                        o[b * 32 + 2 * j + 1] = hi + m;
                    }
                }
            } else if (scale && min) {  /* q4_k, q6_k: a block decoded in its bytes' order, put in column order */
                row_scales(fmt, rec, (int)K, scale, min, nbp);
                for (int b = 0; b < nb; b++) {
                    __m256 c[4];
                    float t[32];
                    decode(fmt, rec, (int)K, b, c);
                    for (int i = 0; i < 4; i++) {
                        __m256 v;
                        if (fmt == Q4_K)  /* (d * scale) * code - dmin * min */
                            v = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(scale[b]), c[i]),
                                              _mm256_set1_ps(-min[b]));
                        else  /* (d * scale) * (code - 32), a scale per 16 columns: vectors 0, 1 and 2, 3 */
                            v = _mm256_mul_ps(_mm256_set1_ps(scale[2 * b + i / 2]), c[i]);
                        _mm256_storeu_ps(t + 8 * i, v);
                    }
                    for (int i = 0; i < 32; i++)
                        o[b * 32 + perm[i]] = t[i];
                }
            }
        }
        free(scale);
        free(min);
    }
    return failed ? -1 : 0;
}
