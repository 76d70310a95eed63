/* Weight-only quantized products of a few rows for CPU decoding (fusion/forward/native_kernels.py builds and
 * loads this file; fusion/forward/quantized.py documents the formats).
 *
 *   int4: out[m, n] = sum_k x[m, k] * (q[n, k] * s[n, g] + b[n, g]),  g = k / 32,  q in [0, 15]
 *         outputs in blocks of 8 (n a multiple of 8): block B, group g holds 128 bytes of codes, byte
 *         32t + 4o + i holding q[8B + o, 32g + 8t + i] in its low nibble and q[8B + o, 32g + 8t + 4 + i] in its
 *         high one; then its 8 scales and 8 biases, float16 (params (n/8, k/32, 2, 8))
 *   int8: out[m, n] = scale[n] * sum_k x[m, k] * q[n, k],  q int8, scale float32
 *
 * Activations and outputs are float32 or bfloat16 (is_bf16). The products are integer ones. For int4 each
 * group of 32 activations becomes a float32 scale d and integer codes c = 128 h + l (|c| <= 128 * 127, about
 * 15 bits a group), held as two signed bytes h and l (|l| <= 64); one SIMD lane holds one output of the
 * block: AVX2's multiply-add of unsigned by signed bytes sums four inputs of eight outputs at once, once for
 * h and once for l, a group's partial sums stay int16 (8 * 2 * 15 * 127 < 32767), and one conversion to
 * float32 per group serves the block's eight outputs, which leave as one vector, with no horizontal sums.
 * A group without outliers keeps h alone (l = 0, its multiply-adds skipped): one byte a code there, as
 * llama.cpp's Q8 blocks everywhere; groups with an outlier keep both (quantize_row_split). Where the compiler
 * targets AVX-512 with its byte dot products (VNNI), each dot product adds four products into an int32 lane (the
 * same sums in fewer instructions), and from PAIR_MIN_ROWS rows two blocks go in one vector (int4_block_pair),
 * each row's activations broadcast once for both; below that, where a product is bound by reading its weights,
 * one block at a time reads them as one stream, which measured faster than two interleaved. For int8 weights each row becomes int16 codes and one scale, multiplied by the
 * multiply-add of int16 pairs (AVX-512's int16 dot product where the compiler targets it), summed in int32. A step of a small model reads each weight once for a few rows, so the loops
 * walk the weights once and keep every row's accumulators in registers (rows in blocks). */

#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define GROUP 32
#define OUT_BLOCK 8        /* the int4 layout's outputs a block */
#define ROW_BLOCK 4        /* rows an int8 weight's loop carries */
#define INT4_ROW_BLOCK 3   /* rows an int4 block's loop carries: two int16 sums and a float32 one each, in registers */
#ifndef INT8_PREFETCH_ROWS
#define INT8_PREFETCH_ROWS 4  /* how many outputs ahead int8_output asks for a row's codes (0: it does not) */
#endif
#ifndef SINGLE_PREFETCH_GROUPS
#define SINGLE_PREFETCH_GROUPS 16  /* how far ahead int4_block asks for its codes (0: it does not) */
#endif
#define CODE_MAX 32767.0f  /* int8 weights' activation codes: int16, a scale a row */
#define SPLIT_MAX 16256.0f /* int4 weights' activation codes: 128 * 127, a scale a group, two bytes each */
#define COARSE_SPREAD 4    /* a group whose max|x| is at most this many times its mean |x| drops its low bytes */

/* COARSE_SPREAD unless set otherwise (fusion_set_coarse_spread; 0: every group keeps both bytes). */
static int coarse_spread = COARSE_SPREAD;

void fusion_set_coarse_spread(int spread) { coarse_spread = spread; }

static float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef __AVX2__
/* 8 bfloat16 values -> float32 (exact: a bfloat16 is a float32's upper half). */
static __m256 widen8_bf16(const uint16_t *src) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}
#endif

/* n bfloat16 values -> float32. */
static void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8_bf16(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

/* x (rows, k) in its dtype -> float32, 32-byte aligned (the caller frees it). */
static float *activations(const void *x, int64_t rows, int64_t k, int is_bf16) {
    size_t bytes = (size_t)(rows * k) * sizeof(float);
    float *out = aligned_alloc(32, (bytes + 31) / 32 * 32);
    if (!out) return NULL;
    if (is_bf16) {
        widen_bf16(x, out, rows * k);
    } else {
        memcpy(out, x, bytes);
    }
    return out;
}

#ifndef __AVX2__  /* (the AVX2 products widen eight halves at once) */
/* IEEE half precision to float32 (F16C's instruction where the compiler targets it). */
static float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  /* inf, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  /* zero or subnormal: mantissa * 2^-24 */
        float f = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}
#endif

static void store(void *out, int64_t index, float value, int is_bf16) {
    if (is_bf16) ((uint16_t *)out)[index] = float_to_bf16(value);
    else ((float *)out)[index] = value;
}

#ifdef __AVX2__
static float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float horizontal_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

/* Activations of one row for the int8 weights' products: x[j] ~ q[j] * d, q int16, d = max|x| / 32767 (one
 * scale a row, so a product needs only the weights' scale at its end: 15 bits a row, against bf16's 8-bit
 * mantissa). */
static void quantize_row_int16(const float *x, int64_t k, int16_t *q, float *d) {
    float amax = 0;
    for (int64_t j = 0; j < k; j++) {
        float a = x[j] < 0 ? -x[j] : x[j];
        if (a > amax) amax = a;
    }
    float inverse = amax > 0 ? CODE_MAX / amax : 0;
    for (int64_t j = 0; j < k; j++) {
        float v = x[j] * inverse;
        q[j] = (int16_t)(v < 0 ? -(int32_t)(-v + 0.5f) : (int32_t)(v + 0.5f));
    }
    *d = amax / CODE_MAX;
}

/* Activations of one row for the int4 weights' products, a group of 32 at a time: x[32g + j] ~ c * d[g],
 * d[g] = max|x| over the group / 16256, c rounded to nearest (ties to even), held as c = 128 high + low with
 * low in [-64, 63]; sums[g] = the exact float sum of the group (the weights' biases multiply it).
 * A group without outliers (coarse_spread * sum |c| >= 32 * 16256: max|x| at most 4 times its mean |x|)
 * keeps only its high bytes (low = 0, fine[g] = 0): its rounding step, max|x| / 127, is then within 3.2% of
 * its mean |x|, and the product skips the low bytes' multiply-adds. Groups with an outlier, which would
 * round their other values to a few steps, keep both bytes (fine[g] = 1). The test is on the integer
 * codes, so every build and the reference decide alike. The spread trades speed for closeness to the
 * two-byte codes (docs/performance.md measures both). */
static void quantize_row_split(const float *x, int64_t k, int8_t *high, int8_t *low, uint8_t *fine, float *d,
                               float *sums) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        float amax = 0, sum = 0;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 most = _mm256_setzero_ps(), total = _mm256_setzero_ps();
        for (int j = 0; j < GROUP; j += 8) {
            __m256 v = _mm256_loadu_ps(xg + j);
            total = _mm256_add_ps(total, v);
            most = _mm256_max_ps(most, _mm256_andnot_ps(sign, v));
        }
        amax = horizontal_max(most);
        sum = horizontal_sum(total);
        const __m256 inverse = _mm256_set1_ps(amax > 0 ? SPLIT_MAX / amax : 0);
        __m256i highs[4], lows[4], magnitude = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * j), inverse),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            magnitude = _mm256_add_epi32(magnitude, _mm256_abs_epi32(c));
            highs[j] = _mm256_srai_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(64)), 7);
            lows[j] = _mm256_sub_epi32(c, _mm256_slli_epi32(highs[j], 7));
        }
        int32_t magnitudes[8];
        _mm256_storeu_si256((__m256i *)magnitudes, magnitude);
        int32_t total_magnitude = 0;
        for (int lane = 0; lane < 8; lane++) total_magnitude += magnitudes[lane];
        fine[g] = coarse_spread * total_magnitude < GROUP * (int32_t)SPLIT_MAX;
        if (!fine[g])
            for (int j = 0; j < 4; j++) lows[j] = _mm256_setzero_si256();
        /* the packs interleave 128-bit lanes: the permutation puts the 32 codes back in order */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i *)(high + g * GROUP), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
            _mm256_packs_epi32(highs[0], highs[1]), _mm256_packs_epi32(highs[2], highs[3])), order));
        _mm256_storeu_si256((__m256i *)(low + g * GROUP), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
            _mm256_packs_epi32(lows[0], lows[1]), _mm256_packs_epi32(lows[2], lows[3])), order));
#else
        float lanes[8] = {0};  /* the vector loop's sums, in its order, so that both builds agree bit for bit */
        for (int j = 0; j < GROUP; j++) {
            float a = xg[j] < 0 ? -xg[j] : xg[j];
            if (a > amax) amax = a;
            lanes[j % 8] += xg[j];
        }
        sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        const float inverse = amax > 0 ? SPLIT_MAX / amax : 0;
        int32_t total_magnitude = 0;
        for (int j = 0; j < GROUP; j++) {
            int32_t c = (int32_t)nearbyintf(xg[j] * inverse), h = (c + 64) >> 7;
            total_magnitude += c < 0 ? -c : c;
            high[g * GROUP + j] = (int8_t)h;
            low[g * GROUP + j] = (int8_t)(c - 128 * h);
        }
        fine[g] = coarse_spread * total_magnitude < GROUP * (int32_t)SPLIT_MAX;
        if (!fine[g]) memset(low + g * GROUP, 0, GROUP);
#endif
        d[g] = amax / SPLIT_MAX;
        sums[g] = sum;
    }
}

typedef struct {
    int bits;       /* the weights' codes these rows are for: 4 (split codes, a scale a group) or 8 (int16, a row) */
    int16_t *q16;   /* (rows, k) */
    int8_t *high, *low;  /* (rows, k) each */
    uint8_t *fine;  /* (rows, k/32): whether the group's low bytes count (quantize_row_split) */
    float *d;       /* (rows, k/32) for 4 bits, (rows,) for 8 */
    float *sums;    /* (rows, k/32) */
} quantized_rows;

/* Room for the codes of `rows` rows of up to k activations, for either weights (free with free_rows). 0, or
 * -1 when out of memory. */
static int alloc_rows(int64_t rows, int64_t k, quantized_rows *out) {
    out->q16 = aligned_alloc(32, (size_t)((rows * k * 2 + 31) / 32 * 32));
    out->high = aligned_alloc(32, (size_t)((rows * k + 31) / 32 * 32));
    out->low = aligned_alloc(32, (size_t)((rows * k + 31) / 32 * 32));
    out->d = malloc((size_t)(rows * (k / GROUP) + rows) * sizeof(float));
    out->sums = malloc((size_t)(rows * (k / GROUP)) * sizeof(float));
    out->fine = malloc((size_t)(rows * (k / GROUP)) + 1);
    return out->q16 && out->high && out->low && out->d && out->sums && out->fine ? 0 : -1;
}

static void quantize_rows(const float *xf, int64_t rows, int64_t k, int bits, quantized_rows *out) {
    out->bits = bits;
    for (int64_t m = 0; m < rows; m++) {
        if (bits == 4)
            quantize_row_split(xf + m * k, k, out->high + m * k, out->low + m * k, out->fine + m * (k / GROUP),
                               out->d + m * (k / GROUP), out->sums + m * (k / GROUP));
        else
            quantize_row_int16(xf + m * k, k, out->q16 + m * k, out->d + m);
    }
}

static void free_rows(quantized_rows *rows) {
    free(rows->q16);
    free(rows->high);
    free(rows->low);
    free(rows->d);
    free(rows->sums);
    free(rows->fine);
}

/* sum_i a[i] * b[i] over n floats. */
static float dot(const float *a, const float *b, int64_t n) {
    float total = 0;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = horizontal_sum(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

#ifdef __AVX2__
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* AVX-512's byte dot product: four products into each int32 lane in one instruction */
#define DOT4(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#define WIDEN(high, low, shift, ones) _mm256_add_epi32(_mm256_slli_epi32(high, 7), low)
#define WIDEN_HIGH(high, ones) (high)  /* the high bytes' sums alone, without the factor 128 */
#else
/* AVX2: two products into each int16 lane, widened to int32 once a group */
#define DOT4(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
#define WIDEN(high, low, shift, ones) _mm256_add_epi32(_mm256_madd_epi16(high, shift), _mm256_madd_epi16(low, ones))
#define WIDEN_HIGH(high, ones) _mm256_madd_epi16(high, ones)
#endif

static __m256i broadcast4(const int8_t *x) {  /* four activation bytes into every 32-bit lane */
    int32_t four;
    memcpy(&four, x, sizeof four);
    return _mm256_set1_epi32(four);
}
#endif

/* Outputs [8b, 8b + 8) of rows [m0, m0 + count) of the int4 product: per group,
 * d_x * s * (q . (128 high + low)) + b * sum_x. Inlined where `count` is a constant (int4_block): the row
 * loops then unroll and every row's accumulators stay in registers. */
static inline __attribute__((always_inline)) void int4_block_rows(
        const quantized_rows *x, int64_t m0, int count, int64_t k, const uint8_t *codes, const uint16_t *params,
        int64_t b, int64_t n_total, void *out, int is_bf16) {
    const int64_t groups = k / GROUP;
    const uint8_t *block = codes + b * groups * 128;
    const uint16_t *block_params = params + b * groups * 2 * OUT_BLOCK;
    const float *d = x->d + m0 * groups, *sums = x->sums + m0 * groups;
    float total[INT4_ROW_BLOCK][OUT_BLOCK];
#ifdef __AVX2__
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), shift = _mm256_set1_epi16(128);
    (void)ones, (void)shift;  /* (VNNI's WIDEN needs neither) */
    __m256 acc[INT4_ROW_BLOCK];
    for (int r = 0; r < INT4_ROW_BLOCK; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i high[INT4_ROW_BLOCK], low[INT4_ROW_BLOCK];  /* int16: two products a lane, over the group's quads */
        int fine[INT4_ROW_BLOCK];  /* the rows whose group has low bytes: the others' are zeros, skipped */
#if SINGLE_PREFETCH_GROUPS > 0
        /* a few groups ahead (past the block's end: the thread's next block, which follows it in memory) */
        _mm_prefetch((const char *)(block + (g + SINGLE_PREFETCH_GROUPS) * 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(block + (g + SINGLE_PREFETCH_GROUPS) * 128 + 64), _MM_HINT_T0);
        if (g % 4 == 0)
            _mm_prefetch((const char *)(block_params + (g + SINGLE_PREFETCH_GROUPS) * 2 * OUT_BLOCK), _MM_HINT_T0);
#endif
        for (int r = 0; r < INT4_ROW_BLOCK; r++) {
            high[r] = low[r] = _mm256_setzero_si256();
            fine[r] = r < count && x->fine[(m0 + r) * groups + g];
        }
        for (int t = 0; t < 4; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(block + g * 128 + t * 32));
            __m256i first = _mm256_and_si256(v, nibble), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int r = 0; r < count; r++) {
                const int64_t at = (m0 + r) * k + g * GROUP + t * 8;
                high[r] = DOT4(high[r], first, broadcast4(x->high + at));
                high[r] = DOT4(high[r], second, broadcast4(x->high + at + 4));
                if (fine[r]) {
                    low[r] = DOT4(low[r], first, broadcast4(x->low + at));
                    low[r] = DOT4(low[r], second, broadcast4(x->low + at + 4));
                }
            }
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block_params + g * 2 * OUT_BLOCK)));
        const __m256 bias = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block_params + g * 2 * OUT_BLOCK + OUT_BLOCK)));
        for (int r = 0; r < count; r++) {
            /* a group without low bytes sums 128 high: its 128 goes into the scale instead (times a power of
             * two, exact both ways), which spares the widening's shift and add */
            const __m256i dot = fine[r] ? WIDEN(high[r], low[r], shift, ones) : WIDEN_HIGH(high[r], ones);
            const float d_g = fine[r] ? d[r * groups + g] : 128.0f * d[r * groups + g];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(d_g)), acc[r]);
            acc[r] = _mm256_fmadd_ps(bias, _mm256_set1_ps(sums[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < count; r++) _mm256_storeu_ps(total[r], acc[r]);
#else
    for (int r = 0; r < count; r++)
        for (int o = 0; o < OUT_BLOCK; o++) total[r][o] = 0;
    for (int64_t g = 0; g < groups; g++)
        for (int o = 0; o < OUT_BLOCK; o++) {
            const float scale = half_to_float(block_params[g * 2 * OUT_BLOCK + o]);
            const float bias = half_to_float(block_params[g * 2 * OUT_BLOCK + OUT_BLOCK + o]);
            for (int r = 0; r < count; r++) {
                const int64_t at = (m0 + r) * k + g * GROUP;
                int32_t high = 0, low = 0;
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = block[g * 128 + t * 32 + 4 * o + i];
                        const int64_t first = at + 8 * t + i, second = first + 4;
                        high += (byte & 0x0f) * x->high[first] + (byte >> 4) * x->high[second];
                        low += (byte & 0x0f) * x->low[first] + (byte >> 4) * x->low[second];
                    }
                /* as the vector loop: its fused multiply-adds, in its order, so that both builds agree */
                total[r][o] = fmaf((float)(128 * high + low), scale * d[r * groups + g], total[r][o]);
                total[r][o] = fmaf(bias, sums[r * groups + g], total[r][o]);
            }
        }
#endif
    for (int r = 0; r < count; r++)
        for (int o = 0; o < OUT_BLOCK; o++) store(out, (m0 + r) * n_total + b * OUT_BLOCK + o, total[r][o], is_bf16);
}

/* int4_block_rows for 1 to INT4_ROW_BLOCK rows, each count its own copy. With the count a variable, the
 * compiler kept the rows' accumulators in memory and branched on the count in the inner loop. */
_Static_assert(INT4_ROW_BLOCK == 3, "int4_block's cases are 1, 2 and INT4_ROW_BLOCK rows");
static void int4_block(const quantized_rows *x, int64_t m0, int count, int64_t k, const uint8_t *codes,
                       const uint16_t *params, int64_t b, int64_t n_total, void *out, int is_bf16) {
    switch (count) {
    case 1: int4_block_rows(x, m0, 1, k, codes, params, b, n_total, out, is_bf16); return;
    case 2: int4_block_rows(x, m0, 2, k, codes, params, b, n_total, out, is_bf16); return;
    case INT4_ROW_BLOCK: int4_block_rows(x, m0, INT4_ROW_BLOCK, k, codes, params, b, n_total, out, is_bf16); return;
    }
    int4_block_rows(x, m0, count, k, codes, params, b, n_total, out, is_bf16);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_ROW_BLOCK 4   /* rows int4_block_pair carries (AVX-512 has 32 vector registers) */
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 16  /* how far ahead int4_block_pair asks for both blocks' codes */
#endif
#ifndef PAIR_MIN_ROWS
#define PAIR_MIN_ROWS 6     /* rows from which int4_block_pair serves */
#endif

static __m512i broadcast4_512(const int8_t *x) {  /* four activation bytes into every 32-bit lane */
    int32_t four;
    memcpy(&four, x, sizeof four);
    return _mm512_set1_epi32(four);
}

/* Outputs [8b, 8b + 16) (blocks b and b + 1) of rows [m0, m0 + count) of the int4 product: int4_block's sums
 * with AVX-512's byte dot product (VNNI), which adds four products into an int32 lane in one instruction
 * (no int16 sums to widen), sixteen outputs a vector, each row's activation bytes broadcast once for both
 * blocks. Every lane's integer and float operations are int4_block's, in its order: both give the same bits. */
static inline __attribute__((always_inline)) void int4_block_pair_rows(
        const quantized_rows *x, int64_t m0, int count, int64_t k, const uint8_t *codes, const uint16_t *params,
        int64_t b, int64_t n_total, void *out, int is_bf16) {
    const int64_t groups = k / GROUP;
    const uint8_t *block = codes + b * groups * 128, *next_block = block + groups * 128;
    const uint16_t *block_params = params + b * groups * 2 * OUT_BLOCK;
    const uint16_t *next_params = block_params + groups * 2 * OUT_BLOCK;
    const float *d = x->d + m0 * groups, *sums = x->sums + m0 * groups;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[VNNI_ROW_BLOCK];
    for (int r = 0; r < VNNI_ROW_BLOCK; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i high[VNNI_ROW_BLOCK], low[VNNI_ROW_BLOCK];
        int fine[VNNI_ROW_BLOCK];
        for (int r = 0; r < VNNI_ROW_BLOCK; r++) {
            high[r] = low[r] = _mm512_setzero_si512();
            fine[r] = r < count && x->fine[(m0 + r) * groups + g];
        }
        for (int line = 0; line < 128; line += 64) {  /* both streams a few groups ahead */
            _mm_prefetch((const char *)(block + (g + PREFETCH_GROUPS) * 128 + line), _MM_HINT_T0);
            _mm_prefetch((const char *)(next_block + (g + PREFETCH_GROUPS) * 128 + line), _MM_HINT_T0);
        }
        for (int t = 0; t < 4; t++) {
            __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(block + g * 128 + t * 32))),
                _mm256_loadu_si256((const __m256i *)(next_block + g * 128 + t * 32)), 1);
            __m512i first = _mm512_and_si512(v, nibble), second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int r = 0; r < count; r++) {
                const int64_t at = (m0 + r) * k + g * GROUP + t * 8;
                high[r] = _mm512_dpbusd_epi32(high[r], first, broadcast4_512(x->high + at));
                high[r] = _mm512_dpbusd_epi32(high[r], second, broadcast4_512(x->high + at + 4));
                if (fine[r]) {
                    low[r] = _mm512_dpbusd_epi32(low[r], first, broadcast4_512(x->low + at));
                    low[r] = _mm512_dpbusd_epi32(low[r], second, broadcast4_512(x->low + at + 4));
                }
            }
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(block_params + g * 2 * OUT_BLOCK))),
            _mm_loadu_si128((const __m128i *)(next_params + g * 2 * OUT_BLOCK)), 1));
        const __m512 bias = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(block_params + g * 2 * OUT_BLOCK + OUT_BLOCK))),
            _mm_loadu_si128((const __m128i *)(next_params + g * 2 * OUT_BLOCK + OUT_BLOCK)), 1));
        for (int r = 0; r < count; r++) {  /* int4_block_rows' widening, its 128 in the scale where no low bytes */
            const __m512i dot = fine[r] ? _mm512_add_epi32(_mm512_slli_epi32(high[r], 7), low[r]) : high[r];
            const float d_g = fine[r] ? d[r * groups + g] : 128.0f * d[r * groups + g];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d_g)), acc[r]);
            acc[r] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < count; r++) {
        float total[2 * OUT_BLOCK];
        _mm512_storeu_ps(total, acc[r]);
        for (int o = 0; o < 2 * OUT_BLOCK; o++) store(out, (m0 + r) * n_total + b * OUT_BLOCK + o, total[o], is_bf16);
    }
}

/* int4_block_pair_rows, a copy for a whole row block and one for fewer rows (as int4_block). */
static void int4_block_pair(const quantized_rows *x, int64_t m0, int count, int64_t k, const uint8_t *codes,
                            const uint16_t *params, int64_t b, int64_t n_total, void *out, int is_bf16) {
    if (count == VNNI_ROW_BLOCK) {
        int4_block_pair_rows(x, m0, VNNI_ROW_BLOCK, k, codes, params, b, n_total, out, is_bf16);
        return;
    }
    int4_block_pair_rows(x, m0, count, k, codes, params, b, n_total, out, is_bf16);
}
#endif

/* Output n of rows [m0, m0 + count) of the int8 product: scale * d_x * (q . q_x). Each row's products sum in
 * int32 lanes over up to INT8_CHUNK inputs (exact), then once into float32: a float conversion a chunk, not one
 * a group of 32, and with AVX-512's int16 dot product (VNNI) each pair of products adds into its lane in one
 * instruction. At a few rows of a wide product (the output head) the per-group conversions and sums were what
 * bound it, not reading its codes. Inlined where `count` is a constant (int8_output), as int4_block_rows is. */
#define INT8_CHUNK 4096  /* inputs a lane's int32 sum takes: k/8 products of at most 127 * 32767 stay below 2^31 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_WIDE 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_PAIRS(acc, w, x) _mm256_dpwssd_epi32(acc, w, x)
#elif defined(__AVX2__)
#define DOT_PAIRS(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#endif
static inline __attribute__((always_inline)) void int8_output_rows(
        const quantized_rows *x, int64_t m0, int count, int64_t k, const int8_t *codes, const void *scale_params,
        int64_t n, int64_t n_total, void *out, int is_bf16) {
    const float *scales = scale_params;
    const int8_t *row = codes + n * k;
    float total[ROW_BLOCK] = {0};
#if INT8_PREFETCH_ROWS > 0
    if (n + INT8_PREFETCH_ROWS < n_total)  /* a later output's codes, a few rows ahead (the thread walks its outputs) */
        for (int64_t line = 0; line < k; line += 64)
            __builtin_prefetch(row + INT8_PREFETCH_ROWS * k + line);
#endif
    for (int64_t c0 = 0; c0 < k; c0 += INT8_CHUNK) {
        const int64_t c1 = c0 + INT8_CHUNK < k ? c0 + INT8_CHUNK : k;
#if defined(INT8_WIDE)
        /* Each row's lanes sum in two int32 accumulators, the even and the odd groups, added once at the end:
         * two dependency chains of half the length. Integer sums that never overflow (INT8_CHUNK) are the
         * same in any order, so each lane's sum, and then the float, is what one accumulator gave. */
        int64_t j = c0;
        __m512i acc[ROW_BLOCK], odd[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; r++) acc[r] = odd[r] = _mm512_setzero_si512();
        for (; j + 2 * GROUP <= c1; j += 2 * GROUP) {  /* two groups: 64 weights as int16, 32 a vector */
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + j)));
            const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + j + GROUP)));
            for (int r = 0; r < count; r++) {
                const int16_t *q = x->q16 + (m0 + r) * k + j;
                acc[r] = _mm512_dpwssd_epi32(acc[r], w0, _mm512_loadu_si512(q));
                odd[r] = _mm512_dpwssd_epi32(odd[r], w1, _mm512_loadu_si512(q + GROUP));
            }
        }
        if (j < c1) {  /* an odd last group */
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + j)));
            for (int r = 0; r < count; r++)
                acc[r] = _mm512_dpwssd_epi32(acc[r], w0, _mm512_loadu_si512(x->q16 + (m0 + r) * k + j));
        }
        for (int r = 0; r < count; r++)
            total[r] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[r], odd[r])));
#elif defined(__AVX2__)
        /* two int32 accumulators a row, as above: the same lane sums, in two chains */
        __m256i acc[ROW_BLOCK], odd[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; r++) acc[r] = odd[r] = _mm256_setzero_si256();
        for (int64_t j = c0; j < c1; j += GROUP) {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + j)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + j + 16)));
            for (int r = 0; r < count; r++) {
                const int16_t *q = x->q16 + (m0 + r) * k + j;
                acc[r] = DOT_PAIRS(acc[r], w0, _mm256_load_si256((const __m256i *)q));
                odd[r] = DOT_PAIRS(odd[r], w1, _mm256_load_si256((const __m256i *)(q + 16)));
            }
        }
        for (int r = 0; r < count; r++) total[r] += horizontal_sum(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[r], odd[r])));
#else
        for (int r = 0; r < count; r++) {
            int32_t lanes[8] = {0};  /* as the AVX2 loop's eight lanes: pairs of products in int32, then float */
            for (int64_t i = c0; i < c1; i++) lanes[(i % 16) / 2] += row[i] * x->q16[(m0 + r) * k + i];
            for (int l = 0; l < 8; l++) total[r] += (float)lanes[l];
        }
#endif
    }
    for (int r = 0; r < count; r++) store(out, (m0 + r) * n_total + n, total[r] * x->d[m0 + r] * scales[n], is_bf16);
}

/* int8_output_rows for 1 to ROW_BLOCK rows, each count its own copy: with the count a variable, the rows'
 * accumulators stayed in memory and the inner loop branched on it. */
_Static_assert(ROW_BLOCK == 4, "int8_output's cases are 1 to ROW_BLOCK rows");
static void int8_output(const quantized_rows *x, int64_t m0, int count, int64_t k, const int8_t *codes,
                        const void *scale_params, int64_t n, int64_t n_total, void *out, int is_bf16) {
    switch (count) {
    case 1: int8_output_rows(x, m0, 1, k, codes, scale_params, n, n_total, out, is_bf16); return;
    case 2: int8_output_rows(x, m0, 2, k, codes, scale_params, n, n_total, out, is_bf16); return;
    case 3: int8_output_rows(x, m0, 3, k, codes, scale_params, n, n_total, out, is_bf16); return;
    case ROW_BLOCK: int8_output_rows(x, m0, ROW_BLOCK, k, codes, scale_params, n, n_total, out, is_bf16); return;
    }
    int8_output_rows(x, m0, count, k, codes, scale_params, n, n_total, out, is_bf16);
}

/* Work a caller has the 4-bit product's parallel region do beside the product, on float32 outputs
 * (decoder_step.c's bias and adapters): `before` runs on every thread of the region before any block (it may
 * hold orphaned `omp for` loops, whose barrier then precedes the blocks), `after_blocks` once a thread has
 * stored every row's outputs of its contiguous run of blocks [first, last), on that thread, while they are
 * still in its cache: one call a run, so that the work runs as long loops over outputs rather than eight at a
 * time. The region is the product's own, so the extra work costs no second team wake-up, and it is dealt to
 * the threads as the product's blocks are: evenly. */
typedef struct {
    void (*before)(const void *context);
    void (*after_blocks)(const void *context, int64_t first, int64_t last, float *out);
    const void *context;
} product_extra;

/* The contiguous share [*first, *last) of `count` items that thread `me` of `team` takes. */
static void share_of(int64_t count, int me, int team, int64_t *first, int64_t *last) {
    *first = count * me / team;
    *last = count * (me + 1) / team;
}

/* out (rows, n) = the quantized rows `q` (k activations each, quantized for `q->bits`) times the 4-bit weight
 * (blocked nibbles and float16 scales and biases, n a multiple of 8) or the 8-bit one (int8 codes, float32
 * scales), over `threads` threads splitting the outputs. `extra` (4-bit weights, float32 outputs; NULL: none):
 * product_extra. */
static void multiply(const quantized_rows *q, int64_t rows, int64_t k, const void *codes, const void *params,
                     int64_t n, void *out, int is_bf16, int threads, const product_extra *extra) {
    if (q->bits == 4) {
#pragma omp parallel num_threads(threads)
        {
            if (extra != NULL) extra->before(extra->context);
            /* each thread walks its blocks' weights once for every row block: a block's codes stay in L1. The
             * shares are contiguous and explicit (not an `omp for`), so that `after_blocks` gets each thread's run. */
            const int team = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t blocks = n / OUT_BLOCK;
            int64_t single = 0;  /* the first block that goes alone (the ones before it went in pairs) */
            int64_t first, last;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            if (rows >= PAIR_MIN_ROWS) {
                share_of(blocks / 2, me, team, &first, &last);
                for (int64_t p = first; p < last; p++)
                    for (int64_t m0 = 0; m0 < rows; m0 += VNNI_ROW_BLOCK)
                        int4_block_pair(q, m0, rows - m0 < VNNI_ROW_BLOCK ? (int)(rows - m0) : VNNI_ROW_BLOCK, k,
                                        codes, params, 2 * p, n, out, is_bf16);
                if (extra != NULL && last > first) extra->after_blocks(extra->context, 2 * first, 2 * last, out);
                single = 2 * (blocks / 2);  /* an odd last block, if any */
            }
#endif
            share_of(blocks - single, me, team, &first, &last);
            for (int64_t b = single + first; b < single + last; b++)
                for (int64_t m0 = 0; m0 < rows; m0 += INT4_ROW_BLOCK)
                    int4_block(q, m0, rows - m0 < INT4_ROW_BLOCK ? (int)(rows - m0) : INT4_ROW_BLOCK, k, codes, params,
                               b, n, out, is_bf16);
            if (extra != NULL && last > first) extra->after_blocks(extra->context, single + first, single + last, out);
        }
        return;
    }
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int count = rows - m0 < ROW_BLOCK ? (int)(rows - m0) : ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t i = 0; i < n; i++) int8_output(q, m0, count, k, codes, params, i, n, out, is_bf16);
    }
}

/* x (rows, k) in its dtype -> out (rows, n), k a multiple of 32. Returns 0, or -1 when a buffer cannot be
 * allocated. */
static int product_of(const void *x, int64_t rows, int64_t k, int bits, const void *codes, const void *params,
                      int64_t n, void *out, int is_bf16, int threads) {
    float *xf = activations(x, rows, k, is_bf16);
    quantized_rows q = {0};
    int status = -1;
    if (xf && alloc_rows(rows, k, &q) == 0) {
        quantize_rows(xf, rows, k, bits, &q);
        multiply(&q, rows, k, codes, params, n, out, is_bf16, threads, NULL);
        status = 0;
    }
    free(xf);
    free_rows(&q);
    return status;
}

int fusion_int4_mm(const void *x, int64_t rows, int64_t k, const uint8_t *codes, const void *params, int64_t n,
                   void *out, int is_bf16, int threads) {
    return product_of(x, rows, k, 4, codes, params, n, out, is_bf16, threads);
}

int fusion_int8_mm(const void *x, int64_t rows, int64_t k, const int8_t *codes, const void *params, int64_t n,
                   void *out, int is_bf16, int threads) {
    return product_of(x, rows, k, 8, codes, params, n, out, is_bf16, threads);
}
