/* Weight-only quantized products of a few rows for CPU decoding (fusion/native_kernels.py builds and
 * loads this file; fusion/quantized.py documents the formats).
 *
 *   int4: out[m, n] = sum_k x[m, k] * (q[n, k] * s[n, g] + b[n, g]),  g = k / 32,  q in [0, 15]
 *         row n: K/2 bytes, group g's byte j holds q[32g + j] (low nibble) and q[32g + 16 + j] (high);
 *         scale_bias[n] = (s[n, :], b[n, :]), float16 (N, 2, K/32), as GGUF's Q4_1 keeps them
 *   int8: out[m, n] = scale[n] * sum_k x[m, k] * q[n, k],  q int8, scale float32
 *
 * Activations and outputs are float32 or bfloat16 (is_bf16). The products are integer ones: each row of
 * activations becomes int16 codes and a float32 scale (quantize_row), multiplied with the weights' codes
 * by AVX2's multiply-add of int16 pairs; each group's sum goes to float32 times its weights' scale. A step of a small model
 * reads each weight once for a few rows, so the loops walk the weights once and keep every row's
 * accumulator in registers (rows in blocks of ROW_BLOCK). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define GROUP 32
#define ROW_BLOCK 4
#define CODE_MAX 32767.0f  /* activations' codes: int16 */

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

/* n bfloat16 values -> float32. */
static void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16)));
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
#endif

/* Activations of one row for the integer products: x[j] ~ q[j] * d, q int16, d = max|x| / 32767 (one scale
 * a row, so a group's product needs only the weights' scale: 15 bits a row, against bf16's 8-bit mantissa);
 * sums[g] = the exact float sum of group g (the 4-bit biases multiply it). */
static void quantize_row(const float *x, int64_t k, int16_t *q, float *d, float *sums) {
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
    for (int64_t g = 0; g < k / GROUP; g++) {
        float sum = 0;
        for (int j = 0; j < GROUP; j++) sum += x[g * GROUP + j];
        sums[g] = sum;
    }
}

typedef struct {
    int16_t *q;     /* (rows, k) */
    float *d;       /* (rows,) */
    float *sums;    /* (rows, k/32) */
} quantized_rows;

/* Room for the codes of `rows` rows of up to k activations (free with free_rows). 0, or -1 when out of
 * memory. */
static int alloc_rows(int64_t rows, int64_t k, quantized_rows *out) {
    out->q = aligned_alloc(32, (size_t)((rows * k * 2 + 31) / 32 * 32));
    out->d = malloc((size_t)rows * sizeof(float));
    out->sums = malloc((size_t)(rows * (k / GROUP)) * sizeof(float));
    return out->q && out->d && out->sums ? 0 : -1;
}

static void quantize_rows(const float *xf, int64_t rows, int64_t k, quantized_rows *out) {
    for (int64_t m = 0; m < rows; m++)
        quantize_row(xf + m * k, k, out->q + m * k, out->d + m, out->sums + m * (k / GROUP));
}

static void free_rows(quantized_rows *rows) {
    free(rows->q);
    free(rows->d);
    free(rows->sums);
}

/* sum_i h[i] * b[i] over n values, h float16. */
static float dot_half(const uint16_t *h, const float *b, int64_t n) {
    float total = 0;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))), _mm256_loadu_ps(b + i), acc);
    total = horizontal_sum(acc);
#endif
    for (; i < n; i++) total += half_to_float(h[i]) * b[i];
    return total;
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
/* (w . x) of one group as 8 int32 partial sums: w0, w1 the group's 32 weights as int16 (16 each), x the
 * row's 32 activation codes. */
static __m256i group_dot(__m256i w0, __m256i w1, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_load_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w1, _mm256_load_si256((const __m256i *)(x + 16))));
}
#endif

/* Output n of rows [m0, m0 + count) of the int4 product: d_x * sum_g s[g] * (q . q_x)[g] + b . sum_x. */
static void int4_output(const quantized_rows *x, int64_t m0, int count, int64_t k, const uint8_t *codes,
                        const void *scale_bias, int64_t n, int64_t n_total, void *out, int is_bf16) {
    const int64_t groups = k / GROUP;
    const uint8_t *row = codes + n * (k / 2);
    const uint16_t *scales = (const uint16_t *)scale_bias + n * groups * 2, *biases = scales + groups;
    float total[ROW_BLOCK] = {0};
#ifdef __AVX2__
    __m256 acc[ROW_BLOCK];
    for (int r = 0; r < ROW_BLOCK; r++) acc[r] = _mm256_setzero_ps();
    const __m128i low_mask = _mm_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        __m128i packed = _mm_loadu_si128((const __m128i *)(row + g * 16));
        __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low_mask));                   /* codes 0..15 */
        __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low_mask));  /* 16..31 */
        __m256 s = _mm256_set1_ps(half_to_float(scales[g]));
        for (int r = 0; r < count; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot(w0, w1, x->q + (m0 + r) * k + g * GROUP)), s, acc[r]);
    }
    for (int r = 0; r < count; r++) total[r] = horizontal_sum(acc[r]);
#else
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < count; r++) {
            const int16_t *xq = x->q + (m0 + r) * k + g * GROUP;
            int32_t sum = 0;
            for (int j = 0; j < 16; j++) {
                uint8_t byte = row[g * 16 + j];
                sum += (byte & 0x0f) * xq[j] + (byte >> 4) * xq[j + 16];
            }
            total[r] += (float)sum * half_to_float(scales[g]);
        }
#endif
    for (int r = 0; r < count; r++) {
        int64_t m = m0 + r;
        store(out, m * n_total + n, total[r] * x->d[m] + dot_half(biases, x->sums + m * groups, groups), is_bf16);
    }
}

/* Output n of rows [m0, m0 + count) of the int8 product: scale * d_x * (q . q_x). */
static void int8_output(const quantized_rows *x, int64_t m0, int count, int64_t k, const int8_t *codes,
                        const void *scale_params, int64_t n, int64_t n_total, void *out, int is_bf16) {
    const float *scales = scale_params;
    const int64_t groups = k / GROUP;
    const int8_t *row = codes + n * k;
    float total[ROW_BLOCK] = {0};
#ifdef __AVX2__
    __m256 acc[ROW_BLOCK];
    for (int r = 0; r < ROW_BLOCK; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {  /* int32 sums of a group, then float32 (no overflow, any k) */
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + g * GROUP)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + g * GROUP + 16)));
        for (int r = 0; r < count; r++)
            acc[r] = _mm256_add_ps(_mm256_cvtepi32_ps(group_dot(w0, w1, x->q + (m0 + r) * k + g * GROUP)), acc[r]);
    }
    for (int r = 0; r < count; r++) total[r] = horizontal_sum(acc[r]);
#else
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < count; r++) {
            int32_t sum = 0;
            for (int j = 0; j < GROUP; j++) sum += row[g * GROUP + j] * x->q[(m0 + r) * k + g * GROUP + j];
            total[r] += (float)sum;
        }
#endif
    for (int r = 0; r < count; r++) store(out, (m0 + r) * n_total + n, total[r] * x->d[m0 + r] * scales[n], is_bf16);
}

/* out (rows, n) = the quantized rows `q` (k activations each) times the 4-bit (`bits` 4: nibbles, float16
 * scales and biases) or 8-bit weight (int8 codes, float32 scales), over `threads` threads splitting the
 * outputs. */
static void multiply(const quantized_rows *q, int64_t rows, int64_t k, int bits, const void *codes,
                     const void *params, int64_t n, void *out, int is_bf16, int threads) {
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int count = rows - m0 < ROW_BLOCK ? (int)(rows - m0) : ROW_BLOCK;
        if (bits == 4) {
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int64_t i = 0; i < n; i++) int4_output(q, m0, count, k, codes, params, i, n, out, is_bf16);
        } else {
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int64_t i = 0; i < n; i++) int8_output(q, m0, count, k, codes, params, i, n, out, is_bf16);
        }
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
        quantize_rows(xf, rows, k, &q);
        multiply(&q, rows, k, bits, codes, params, n, out, is_bf16, threads);
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
