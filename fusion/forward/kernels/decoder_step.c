/* A Llama-family decode step's decoder layers in one call, for rows of one new token each (a session's
 * next id, or one of a prompt's ids over its history: each row's arithmetic is the same either way), over 4- or
 * 8-bit weights (fusion/forward/native_step.py builds the layer table and calls it; fusion/forward/llama.py documents
 * the arithmetic). Eagerly, torch runs each layer as dozens of small operators whose dispatch costs more
 * than the layer's arithmetic at one row; here a layer is its four quantized products (quantized_mm.c's
 * kernels) and a few loops over float32 activations:
 *
 *   h = rmsnorm(x) ; qkv = h W_qkv (+ bias) (+ adapter) ; rotary(q, k) ; attention over the cached columns
 *   (masked) and the new key ; x += attn W_o (+ adapter) ; h = rmsnorm(x) ;
 *   x += (silu(h W_gate) * h W_up) W_down (+ adapters)
 *
 * Adapters are LoRA stacks as fusion/experts/multi_lora.py lays them out: `down` (columns, k) and `up` (columns, n)
 * hold every adapter's matrices side by side (bfloat16 where that holds them exactly, else float32), adapter a
 * owning columns [ranges[2a], ranges[2a + 1]); a row with adapter a adds ((x down)[cols of a]) up[cols of a].
 * Cached keys and values are read in place (bfloat16 or float32, any strides but a contiguous last axis); the
 * new ones are written out, float32, for the caller to append, or (`append`) into the cache's next column
 * (or the columns the caller names). */

/* (library.c includes quantized_mm.c first: its products and helpers serve here) */

#include <math.h>
#include <omp.h>

enum { QKV, O, GATE_UP, DOWN, PROJECTIONS };

/* Where the layers' time goes, for benchmarks/step_parts.py: built with -DFUSION_STEP_CLOCKS, each phase's wall
 * time accumulates until `fusion_step_clocks` reads and clears it; without the flag the marks compile to
 * nothing and the reader reports no phases. The sums are global: one caller at a time. */
enum { CLOCK_NORMS, CLOCK_PRODUCTS, CLOCK_ADAPTERS, CLOCK_ROTARY_KV, CLOCK_ATTENTION, CLOCK_ACTIVATION,
       CLOCK_RESIDUAL, CLOCK_SETUP, CLOCK_PHASES };
#ifdef FUSION_STEP_CLOCKS
#include <time.h>
static double step_clocks[CLOCK_PHASES];
static double clock_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define CLOCK_START() double clock_mark = clock_now()
#define CLOCK_LAP(phase) do { double now_ = clock_now(); step_clocks[phase] += now_ - clock_mark; clock_mark = now_; } while (0)
#else
#define CLOCK_START() ((void)0)
#define CLOCK_LAP(phase) ((void)0)
#endif

/* Copies the phases' seconds (up to n) into out and clears them; returns how many phases there are, 0 when the
 * library was built without the clocks. */
int64_t fusion_step_clocks(double *out, int64_t n) {
#ifdef FUSION_STEP_CLOCKS
    for (int64_t i = 0; i < CLOCK_PHASES; i++) {
        if (i < n) out[i] = step_clocks[i];
        step_clocks[i] = 0.0;
    }
    return CLOCK_PHASES;
#else
    (void)out;
    (void)n;
    return 0;
#endif
}

typedef struct {
    const void *codes;    /* 4-bit: (n/8, 4k) nibbles in blocks of 8 outputs (quantized_mm.c); 8-bit: (n, k) int8 */
    const void *params;   /* 4-bit: (n/8, k/32, 2, 8) float16 scales and biases; 8-bit: (n,) float32 scales */
    int64_t n, k;
    int bits;             /* 4 or 8 */
} quantized_weight;

typedef struct {
    const void *down;        /* (columns, k); NULL: the projection has no adapters */
    const void *up;          /* (columns, n), scaled */
    const int64_t *ranges;   /* (adapters, 2): the columns [start, stop) of each adapter */
    const int64_t *spans;    /* (columns, 2): the outputs [start, stop) outside which a column's `up` row is 0 */
    int64_t columns, adapters;
    int is_bf16;             /* down and up bfloat16 (else float32) */
} lora_stack;

typedef struct {
    quantized_weight projection[PROJECTIONS];
    lora_stack lora[PROJECTIONS];
    const float *qkv_bias;    /* (n_qkv,) or NULL */
    const float *input_norm;  /* (hidden,) */
    const float *post_norm;
    const void *keys, *values;          /* cached columns of this layer */
    int64_t key_strides[3], value_strides[3];  /* row, head, column (elements) */
} decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    int64_t rows;          /* B */
    int64_t cache_rows;    /* 1 (one history serves every row) or B */
    int64_t width;         /* cached columns */
    int cache_is_bf16;
    const uint8_t *mask;   /* (mask_rows, width): the columns each row attends */
    int64_t mask_rows;     /* 1 or B */
    const int64_t *adapter_rows;  /* (B,): each row's adapter, -1 none; NULL: no adapters */
    const float *cos, *sin;       /* (B, head_dim) */
    int threads;
    int append;            /* 1: each row's new key and value go into its cache row (cache_rows B), or the one
                              history (cache_rows 1, with `columns`), not into new_keys / new_values: at column
                              `width` (the caller's buffers have room), or at columns[m] */
    const int64_t *columns;  /* (B,) or NULL: with `append`, the column each row's key and value go into. Rows
                                of one history (a prompt's ids, one a row) each write their column before any
                                row attends, so a row's mask may take the columns of the rows before it */
} step_shape;

/* dim values of the cache (bfloat16 or float32) from `offset` as float32; the cache itself where it is
 * float32, else `scratch`. */
static const float *cached_row(const void *cache, int64_t offset, int64_t dim, int is_bf16, float *scratch) {
    if (!is_bf16) return (const float *)cache + offset;
    widen_bf16((const uint16_t *)cache + offset, scratch, dim);
    return scratch;
}

/* n float32 values into the cache (bfloat16 or float32) from `offset`. */
static void store_cached(void *cache, int64_t offset, const float *v, int64_t n, int is_bf16) {
    if (!is_bf16) {
        memcpy((float *)cache + offset, v, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) ((uint16_t *)cache)[offset + i] = float_to_bf16(v[i]);
}

/* sum_i a[i] * b[i] over n values, b bfloat16: `dot`'s sums in `dot`'s order (widening is exact). */
static float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    float total = 0;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), widen8_bf16(b + i), acc);
    total = horizontal_sum(acc);
#endif
    for (; i < n; i++) total += a[i] * bf16_to_float(b[i]);
    return total;
}

#ifdef __AVX2__
/* e^x of 8 floats (Cephes' expf: a degree-6 polynomial of the remainder after ln 2 multiples, about an ulp);
 * below -88.38, 0 (-inf: exactly 0). */
static __m256 exp8(__m256 x) {
    const __m256 floor = _mm256_set1_ps(-88.3762626647949f), ceiling = _mm256_set1_ps(88.3762626647949f);
    const __m256 below = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, floor), ceiling);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(below, _mm256_mul_ps(y, _mm256_castsi256_ps(power)));
}
#endif

/* out = silu(gate) * up over n values: gate / (1 + e^-gate) * up, the exponentials eight at a time (exp8) where
 * AVX2 is. An output depends only on its own gate and up, never on n or its place among them beyond which of
 * the two paths computes it, so a row's activations are the same whatever rows share the step. */
static void silu_times(const float *gate, const float *up, int64_t n, float *out) {
    int64_t j = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j);
        const __m256 e = exp8(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
    }
#endif
    for (; j < n; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

/* p = softmax(p) over n floats in place (-inf: weight 0). */
static void softmax(float *p, int64_t n) {
    float top = -INFINITY, total = 0;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 most = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(p + i));
    top = horizontal_max(most);
#endif
    for (; i < n; i++)
        if (p[i] > top) top = p[i];
    i = 0;
#ifdef __AVX2__
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
        _mm256_storeu_ps(p + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = horizontal_sum(sum);
#endif
    for (; i < n; i++) total += (p[i] = expf(p[i] - top));
    const float inverse = 1.0f / total;
    for (i = 0; i < n; i++) p[i] *= inverse;
}

/* out += p * v over n floats. */
static void add_scaled(float *out, float p, const float *v, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    __m256 scale = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
#endif
    for (; i < n; i++) out[i] += p * v[i];
}

static void rms_norm(const float *x, const float *weight, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * n;
        float squares = dot(row, row, n);
        float inverse = 1.0f / sqrtf(squares / (float)n + eps);
        for (int64_t i = 0; i < n; i++) out[m * n + i] = row[i] * inverse * weight[i];
    }
}

/* out (rows, n) = rms_norm of x (rows, n): the final norm after the C layers (fusion/forward/llama.py), one call
 * where torch dispatches seven operators for it. */
void fusion_rms_norm(const float *x, const float *weight, int64_t rows, int64_t n, float eps, float *out) {
    rms_norm(x, weight, rows, n, eps, out);
}

/* out (rows, w->n) = x (rows, w->k) times the quantized weight; `q` is scratch for the rows' codes. */
static void product(const float *x, int64_t rows, const quantized_weight *w, quantized_rows *q, float *out,
                    int threads) {
    quantize_rows(x, rows, w->k, w->bits, q);
    multiply(q, rows, w->k, w->codes, w->params, w->n, out, 0, threads, NULL);
}

#define DOWN_COLUMNS 4  /* adapter columns one pass over a row's activations sums at once */
#define GROUP_SCORES_MAX 8  /* query heads a kv head's scores sum at once (group_scores; more: one at a time) */

/* t[j] = the dot product of x (k) with `down`'s row j (bfloat16 or float32), j < count: for DOWN_COLUMNS rows,
 * their sums interleaved in one pass over x (one multiply-add's latency hides behind the others', where a
 * lone sum waits for its previous step), each with dot / dot_bf16's operations in their order (one vector
 * sum over the whole eights, then the tail's), so the same bits. */
static void dot_columns(const float *x, const void *down, int is_bf16, int64_t k, int64_t count, float *t) {
#ifdef __AVX2__
    if (count == DOWN_COLUMNS) {
        __m256 acc[DOWN_COLUMNS];
        for (int j = 0; j < DOWN_COLUMNS; j++) acc[j] = _mm256_setzero_ps();
        int64_t i = 0;
        if (is_bf16)
            for (; i + 8 <= k; i += 8) {
                const __m256 xv = _mm256_loadu_ps(x + i);
                for (int j = 0; j < DOWN_COLUMNS; j++)
                    acc[j] = _mm256_fmadd_ps(xv, widen8_bf16((const uint16_t *)down + j * k + i), acc[j]);
            }
        else
            for (; i + 8 <= k; i += 8) {
                const __m256 xv = _mm256_loadu_ps(x + i);
                for (int j = 0; j < DOWN_COLUMNS; j++)
                    acc[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps((const float *)down + j * k + i), acc[j]);
            }
        for (int j = 0; j < DOWN_COLUMNS; j++) {
            float total = horizontal_sum(acc[j]);
            for (int64_t tail = i; tail < k; tail++)
                total += x[tail] * (is_bf16 ? bf16_to_float(((const uint16_t *)down)[j * k + tail])
                                            : ((const float *)down)[j * k + tail]);
            t[j] = total;
        }
        return;
    }
#endif
    for (int64_t j = 0; j < count; j++)
        t[j] = is_bf16 ? dot_bf16(x, (const uint16_t *)down + j * k, k) : dot(x, (const float *)down + j * k, k);
}

/* t (rows, columns) = x down, for each row's adapter's columns, DOWN_COLUMNS at a time: an orphaned `omp for`
 * (with its barrier), run inside the caller's parallel region. The (row, columns) items go to the threads in
 * turn (chunks of one), so that rows without an adapter (the base's) leave no thread idle. */
static void adapters_down_rows(const lora_stack *s, const int64_t *adapter_rows, const float *x, int64_t rows,
                               int64_t k, float *t) {
    const int64_t columns = s->columns, groups = (columns + DOWN_COLUMNS - 1) / DOWN_COLUMNS;
    const size_t width = s->is_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp for collapse(2) schedule(static, 1)
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t a = adapter_rows[m];
            if (a < 0 || a >= s->adapters) continue;
            const int64_t lo = g * DOWN_COLUMNS > s->ranges[2 * a] ? g * DOWN_COLUMNS : s->ranges[2 * a];
            const int64_t hi = (g + 1) * DOWN_COLUMNS < s->ranges[2 * a + 1] ? (g + 1) * DOWN_COLUMNS : s->ranges[2 * a + 1];
            if (lo >= hi) continue;
            dot_columns(x + m * k, (const char *)s->down + (size_t)(lo * k) * width, s->is_bf16, k, hi - lo,
                        t + m * columns + lo);
        }
}

/* out[i] += p[j] * v[j * stride + i] for each column j < columns in turn, i < count (v bfloat16 or float32):
 * add_scaled's multiply-adds of each column (bfloat16 rows widened, exactly), fused into one pass over out, each output
 * kept in a register across the columns rather than loaded and stored once a column. Each output takes the
 * same operations in the same order (the vector ones on the same whole eights, the tail's after them), so
 * the same bits. */
static void add_scaled_columns(float *out, const float *p, const void *v, int is_bf16, int64_t stride,
                               int64_t columns, int64_t count) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= count; i += 8) {
        __m256 acc = _mm256_loadu_ps(out + i);
        for (int64_t j = 0; j < columns; j++) {
            const __m256 w = is_bf16 ? widen8_bf16((const uint16_t *)v + j * stride + i)
                                     : _mm256_loadu_ps((const float *)v + j * stride + i);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), w, acc);
        }
        _mm256_storeu_ps(out + i, acc);
    }
#endif
    for (; i < count; i++)
        for (int64_t j = 0; j < columns; j++)
            out[i] += p[j] * (is_bf16 ? bf16_to_float(((const uint16_t *)v)[j * stride + i])
                                      : ((const float *)v)[j * stride + i]);
}

/* out (rows, n) over outputs [j0, j1) += each row's `up` terms from t: each column's `up` row over its span
 * within the range, the columns that share a span (an adapted part's rank) in one pass (add_scaled_columns).
 * A column's `up` row is read only over its span of outputs: a fused projection's stack is block-diagonal
 * (each adapted part's columns write that part's outputs), so the zeros outside the spans are skipped, not
 * multiplied. */
static void adapters_up_range(const lora_stack *s, const int64_t *adapter_rows, const float *t, int64_t rows,
                              int64_t n, int64_t j0, int64_t j1, float *out) {
    const size_t width = s->is_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t m = 0; m < rows; m++) {
        const int64_t a = adapter_rows[m];
        if (a < 0 || a >= s->adapters) continue;
        for (int64_t c = s->ranges[2 * a], next; c < s->ranges[2 * a + 1]; c = next) {
            for (next = c + 1; next < s->ranges[2 * a + 1] && s->spans[2 * next] == s->spans[2 * c]
                               && s->spans[2 * next + 1] == s->spans[2 * c + 1]; next++) {}
            const int64_t lo = s->spans[2 * c] > j0 ? s->spans[2 * c] : j0;
            const int64_t hi = s->spans[2 * c + 1] < j1 ? s->spans[2 * c + 1] : j1;
            if (lo >= hi) continue;
            add_scaled_columns(out + m * n + lo, t + m * s->columns + c,
                               (const char *)s->up + (size_t)(c * n + lo) * width, s->is_bf16, n, next - c, hi - lo);
        }
    }
}

/* out (rows, n) += each row's adapter delta of x (rows, k); `t` is scratch of rows * columns floats. */
#define SPAN_BLOCK 256
static void add_adapters(const lora_stack *s, const int64_t *adapter_rows, const float *x, int64_t rows, int64_t k,
                         int64_t n, float *out, float *t, int threads) {
    if (s->down == NULL || adapter_rows == NULL) return;
#pragma omp parallel num_threads(threads)
    {
        adapters_down_rows(s, adapter_rows, x, rows, k, t);
#pragma omp for schedule(static)
        for (int64_t j0 = 0; j0 < n; j0 += SPAN_BLOCK)
            adapters_up_range(s, adapter_rows, t, rows, n, j0, j0 + SPAN_BLOCK < n ? j0 + SPAN_BLOCK : n, out);
    }
}

/* A projection's bias and adapter deltas as work of its 4-bit product's region (quantized_mm.c's product_extra):
 * the same arithmetic as adding the bias and then add_adapters after the product, through the same two loops
 * (adapters_down_rows, adapters_up_range), each output's terms in the same order: the same bits either way. */
typedef struct {
    const lora_stack *lora;      /* NULL or without `down`: no adapters */
    const int64_t *adapter_rows;
    const float *bias;           /* (n,) or NULL */
    const float *x;              /* (rows, k): the product's input, which the adapters' `down` reads */
    float *t;                    /* (rows, columns): x down, for each row's adapter's columns */
    int64_t rows, k, n;
} projection_extra;

static void adapters_down(const void *context) {
    const projection_extra *e = context;
    if (e->lora == NULL || e->lora->down == NULL || e->adapter_rows == NULL) return;
    adapters_down_rows(e->lora, e->adapter_rows, e->x, e->rows, e->k, e->t);
}

static void bias_and_adapters_up(const void *context, int64_t first, int64_t last, float *out) {
    const projection_extra *e = context;
    const int64_t j0 = first * OUT_BLOCK, j1 = last * OUT_BLOCK, n = e->n;
    if (e->bias != NULL)
        for (int64_t m = 0; m < e->rows; m++)
            for (int64_t j = j0; j < j1; j++) out[m * n + j] += e->bias[j];
    if (e->lora == NULL || e->lora->down == NULL || e->adapter_rows == NULL) return;
    adapters_up_range(e->lora, e->adapter_rows, e->t, e->rows, n, j0, j1, out);
}

/* out (rows, w->n) = x w (+ bias) (+ each row's adapter delta): for 4-bit weights in the product's own region
 * (projection_extra), else product, bias and add_adapters one after another. */
static void project(const float *x, int64_t rows, const quantized_weight *w, const float *bias, const lora_stack *lora,
                    const int64_t *adapter_rows, quantized_rows *q, float *t, float *out, int threads) {
    if (w->bits == 4) {
        const projection_extra e = {lora, adapter_rows, bias, x, t, rows, w->k, w->n};
        const product_extra extra = {adapters_down, bias_and_adapters_up, &e};
        const int any = bias != NULL || (lora->down != NULL && adapter_rows != NULL);
        quantize_rows(x, rows, w->k, w->bits, q);
        multiply(q, rows, w->k, w->codes, w->params, w->n, out, 0, threads, any ? &extra : NULL);
        return;
    }
    product(x, rows, w, q, out, threads);
    if (bias != NULL)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t j = 0; j < w->n; j++) out[m * w->n + j] += bias[j];
    add_adapters(lora, adapter_rows, x, rows, w->k, w->n, out, t, threads);
}

/* transformers' rotate_half rotary embedding of one head (dim values) in place. */
static void rotate(float *x, const float *cos, const float *sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

#define MAX_GROUP 8  /* query heads a kv head serves, up to which weigh_values keeps their sums in registers */
#ifndef ATTEND_PREFETCH_COLUMNS
#define ATTEND_PREFETCH_COLUMNS 16  /* how many columns ahead attention asks for a cached key's or value's bytes */
#endif

/* Ask for the cache lines of n cells (of `cell` bytes) at `offset` in the cache: a hint, it never faults, so
 * it may run past the columns in use. Over a long history the keys and values come from memory, and a
 * column's read otherwise waits for them. */
static inline void prefetch_cached(const void *cache, int64_t offset, int64_t n, size_t cell) {
    const char *first = (const char *)cache + (size_t)offset * cell;
    for (size_t at = 0; at < (size_t)n * cell; at += 64) __builtin_prefetch(first + at);
}
#define MAX_EIGHTS 4  /* eights of a head's outputs weigh_values sums in one pass over the values */
#define EIGHTS_FOR(group) ((group) <= 3 ? 4 : (group) <= 6 ? 2 : 1)  /* at most 12 sums in registers */

#ifdef __AVX2__
/* o (group, dim), outputs [i0, i0 + 8 * eights) of each head, += the attended columns' values weighted by each
 * head's scores, column after column: every sum in a register across all the columns, each value's eights
 * read (and widened) once for the group, and the group * eights sums independent, so that the multiply-adds'
 * latency overlaps. Inlined where `group` and `eights` are constants (weigh_eights). */
static inline __attribute__((always_inline)) void weigh_eights_of(
        const void *values, int is_bf16, int64_t value_base, int64_t step, const uint8_t *mask, int64_t width,
        const float *score, int64_t stride, int group, int eights, int64_t i0, int64_t dim, float *o) {
    __m256 acc[MAX_GROUP * MAX_EIGHTS];
    for (int h = 0; h < group; h++)
        for (int e = 0; e < eights; e++) acc[h * eights + e] = _mm256_loadu_ps(o + h * dim + i0 + 8 * e);
    for (int64_t c = 0, j = 0; c < width; c++) {
#if ATTEND_PREFETCH_COLUMNS > 0
        prefetch_cached(values, value_base + (c + ATTEND_PREFETCH_COLUMNS) * step + i0, 8 * eights,
                        is_bf16 ? sizeof(uint16_t) : sizeof(float));
#endif
        if (!mask[c]) continue;
        const int64_t at = value_base + c * step + i0;
        __m256 v[MAX_EIGHTS];
        for (int e = 0; e < eights; e++)
            v[e] = is_bf16 ? widen8_bf16((const uint16_t *)values + at + 8 * e)
                           : _mm256_loadu_ps((const float *)values + at + 8 * e);
        for (int h = 0; h < group; h++) {
            const __m256 weight = _mm256_set1_ps(score[h * stride + j]);
            for (int e = 0; e < eights; e++) acc[h * eights + e] = _mm256_fmadd_ps(weight, v[e], acc[h * eights + e]);
        }
        j++;
    }
    for (int h = 0; h < group; h++)
        for (int e = 0; e < eights; e++) _mm256_storeu_ps(o + h * dim + i0 + 8 * e, acc[h * eights + e]);
}

/* weigh_eights_of for a group of 1 to MAX_GROUP heads, with EIGHTS_FOR(group) eights a pass (`wide`) or one;
 * each case its own copy, with its sums in registers. Larger groups are the callers' to route elsewhere
 * (weigh_values and attend_splits check group <= MAX_GROUP): here they would do nothing. */
static void weigh_eights(const void *values, int is_bf16, int64_t value_base, int64_t step, const uint8_t *mask,
                         int64_t width, const float *score, int64_t stride, int64_t group, int wide, int64_t i0,
                         int64_t dim, float *o) {
#define WEIGH_CASE(g) case g: \
        if (wide) weigh_eights_of(values, is_bf16, value_base, step, mask, width, score, stride, g, EIGHTS_FOR(g), \
                                  i0, dim, o); \
        else weigh_eights_of(values, is_bf16, value_base, step, mask, width, score, stride, g, 1, i0, dim, o); \
        return;
    switch (group) {
    WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4) WEIGH_CASE(5) WEIGH_CASE(6) WEIGH_CASE(7) WEIGH_CASE(8)
    }
#undef WEIGH_CASE
}
#endif

/* o (group, dim) += the attended columns' values weighted by each head's scores (score[h * stride + j] for the
 * j-th attended column): add_scaled's multiply-adds, column after column. With AVX2, each 8 outputs of every
 * head are summed in registers across all the columns (weigh_eights), several eights a pass, and each value
 * is read (and widened) once for the group: over a long history this was most of attention's time, spent
 * loading and storing the outputs, then waiting on each sum's previous multiply-add. The same operations in
 * the same order for every output, so the same bits. `row`: dim floats of scratch. */
static void weigh_values(const decoder_layer *layer, const step_shape *s, const uint8_t *mask, int64_t value_base,
                         const float *score, int64_t stride, int64_t group, float *row, float *o) {
    const int64_t dim = s->head_dim, width = s->width, step = layer->value_strides[2];
    const int is_bf16 = s->cache_is_bf16;
#ifdef __AVX2__
    int64_t i = 0;
    if (group <= MAX_GROUP) {
        const int64_t wide = 8 * EIGHTS_FOR(group);
        for (; i + wide <= dim; i += wide)
            weigh_eights(layer->values, is_bf16, value_base, step, mask, width, score, stride, group, 1, i, dim, o);
        for (; i + 8 <= dim; i += 8)
            weigh_eights(layer->values, is_bf16, value_base, step, mask, width, score, stride, group, 0, i, dim, o);
        if (i == dim) return;
        for (int64_t c = 0, j = 0; c < width; c++) {  /* the last dim % 8 outputs, as add_scaled's tail */
            if (!mask[c]) continue;
            const float *value = cached_row(layer->values, value_base + c * step, dim, is_bf16, row);
            for (int64_t h = 0; h < group; h++)
                for (int64_t k = i; k < dim; k++) o[h * dim + k] += score[h * stride + j] * value[k];
            j++;
        }
        return;
    }
#endif
    for (int64_t c = 0, j = 0; c < width; c++) {
        if (!mask[c]) continue;
        const float *value = cached_row(layer->values, value_base + c * step, dim, is_bf16, row);
        for (int64_t h = 0; h < group; h++) add_scaled(o + h * dim, score[h * stride + j], value, dim);
        j++;
    }
}

/* score[h * stride] = dot(q + h * dim, key, dim) * scale for the `group` query heads that share a cached key
 * (at `offset` in the cache, bfloat16 or float32): their sums interleaved in one pass over the key (one
 * multiply-add's latency hides behind the others', where a lone sum waits for its previous step), the key
 * widened as it is read, each sum with dot's operations in its order (one vector sum over the whole eights,
 * then the tail's), so the same bits. Inlined where `group` is a constant (group_scores). `row`: dim floats of
 * scratch. */
static inline __attribute__((always_inline)) void group_scores_of(const float *q, const void *cache, int64_t offset,
                                                                  int is_bf16, int64_t dim, int group, float scale,
                                                                  float *score, int64_t stride, float *row) {
#ifdef __AVX2__
    __m256 acc[GROUP_SCORES_MAX];
    for (int h = 0; h < group; h++) acc[h] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 k = is_bf16 ? widen8_bf16((const uint16_t *)cache + offset + i)
                                 : _mm256_loadu_ps((const float *)cache + offset + i);
        for (int h = 0; h < group; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + i), k, acc[h]);
    }
    for (int h = 0; h < group; h++) {
        float total = horizontal_sum(acc[h]);
        for (int64_t tail = i; tail < dim; tail++)
            total += q[h * dim + tail] * (is_bf16 ? bf16_to_float(((const uint16_t *)cache)[offset + tail])
                                                  : ((const float *)cache)[offset + tail]);
        score[h * stride] = total * scale;
    }
    (void)row;
#else
    const float *key = cached_row(cache, offset, dim, is_bf16, row);
    for (int h = 0; h < group; h++) score[h * stride] = dot(q + h * dim, key, dim) * scale;
#endif
}

/* group_scores_of, a copy for each group size up to GROUP_SCORES_MAX (the accumulators then stay in
 * registers), one head at a time beyond. */
static void group_scores(const float *q, const void *cache, int64_t offset, int is_bf16, int64_t dim, int64_t group,
                         float scale, float *score, int64_t stride, float *row) {
#define SCORES_CASE(g) case g: group_scores_of(q, cache, offset, is_bf16, dim, g, scale, score, stride, row); return;
    switch (group) {
    SCORES_CASE(1) SCORES_CASE(2) SCORES_CASE(3) SCORES_CASE(4) SCORES_CASE(5) SCORES_CASE(6) SCORES_CASE(7)
    SCORES_CASE(8)
    }
#undef SCORES_CASE
    const float *key = cached_row(cache, offset, dim, is_bf16, row);
    for (int64_t h = 0; h < group; h++) score[h * stride] = dot(q + h * dim, key, dim) * scale;
}

/* One head's query q (dim) against its row's new key, after the `attended` scores already in p: the new key's
 * score last, the softmax over all of them, and o (dim) started as the new value weighted by its probability
 * (the cached values' weighted sum is added after). attend and attend_split both end a head's scores so. */
static void attend_new_key(const float *q, const float *k_new, const float *v_new, int64_t dim, float scale, float *p,
                           int64_t attended, float *o) {
    p[attended] = dot(q, k_new, dim) * scale;
    softmax(p, attended + 1);
    for (int64_t i = 0; i < dim; i++) o[i] = p[attended] * v_new[i];
}

/* Each row's heads attend the cached columns its mask allows, in column order, and its own new key last:
 * out (B, heads * dim). The attended columns' scores are packed before the softmax, so that a row's result
 * depends on those columns' keys and values alone, not on where they sit among masked ones (a batch row's
 * left padding, a cohort wider than the row's history, a chunk's later rows): one history gives the same
 * bits in any batch. One task per row and kv head: each cached key and value is read (and widened from
 * bfloat16) once for the group of query heads that share it. `scratch` holds, per thread,
 * group * (width + 1) + dim floats (attend_scratch). */
static int64_t attend_scratch(const step_shape *s) {
    return s->heads / s->kv_heads * (s->width + 1) + s->head_dim;
}

#ifndef ATTEND_SPLIT_WIDTH
#define ATTEND_SPLIT_WIDTH 256  /* cached columns from which attention splits its work finer (attend_split) */
#endif
#define SCORE_CHUNK 64  /* attended columns one task of attend_split's scores takes */

/* Whether attend_split serves this step: a long history, too few (row, kv head) tasks to keep every thread
 * busy (fewer than two a thread; with more, one task each balances, and the split's shared scores, which
 * grow with rows times columns, would grow with a long prompt's rows too), a group whose sums stay in
 * registers, whole eights. */
static int attend_splits(const step_shape *s) {
#ifdef __AVX2__
    return s->width >= ATTEND_SPLIT_WIDTH && s->rows * s->kv_heads < 2 * (int64_t)s->threads
           && s->heads / s->kv_heads <= MAX_GROUP && s->head_dim % 8 == 0;
#else
    (void)s;
    return 0;  /* the plain build keeps one task per row and kv head */
#endif
}

/* attend_split's scratch shared by the threads, in floats: every row's heads' scores (rows, heads, width + 1),
 * then each row's attended columns (rows, width) and their count (rows,), as int32. */
static int64_t attend_shared_scratch(const step_shape *s) {
    return attend_splits(s) ? s->rows * s->heads * (s->width + 1) + s->rows * (s->width + 1) : 0;
}

/* attend, its work split finer over a long history: one task per row and kv head left a thread idle for a
 * third of attention at one row of three kv heads on two threads, and attention is most of a step over a
 * long history. Three phases, a barrier apart: the scores, by row, kv head and chunk of attended columns;
 * each head's new key and softmax, by row and head; the weighted values, by row, kv head and pass of
 * eights of outputs. Every score, softmax and output takes attend's operations in attend's order, so the
 * same bits. */
#ifdef __AVX2__
static void attend_split(const decoder_layer *layer, const step_shape *s, const float *qkv, int64_t qkv_width,
                         float *scratch, float *out) {
    const int64_t rows = s->rows, heads = s->heads, kv_heads = s->kv_heads, dim = s->head_dim, width = s->width;
    const int64_t group = heads / kv_heads, stride = width + 1;
    const float scale = 1.0f / sqrtf((float)dim);
    const int is_bf16 = s->cache_is_bf16;
    const size_t cell = is_bf16 ? sizeof(uint16_t) : sizeof(float);
    float *scores = scratch + s->threads * attend_scratch(s);  /* (rows, heads, width + 1) */
    int32_t *columns = (int32_t *)(scores + rows * heads * stride);  /* (rows, width): each row's attended columns */
    int32_t *attended = columns + rows * width;  /* (rows,) */
    const int64_t chunks = (width + SCORE_CHUNK - 1) / SCORE_CHUNK;
    const int64_t wide = EIGHTS_FOR(group), passes = (dim / 8 + wide - 1) / wide;
#pragma omp parallel num_threads(s->threads)
    {
        float *row = scratch + (int64_t)omp_get_thread_num() * attend_scratch(s);  /* dim floats of scratch */
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            const uint8_t *mask = s->mask + (s->mask_rows == 1 ? 0 : m) * width;
            int32_t n = 0;
            for (int64_t c = 0; c < width; c++)
                if (mask[c]) columns[m * width + n++] = (int32_t)c;
            attended[m] = n;
        }
#pragma omp for collapse(3) schedule(static)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t g = 0; g < kv_heads; g++)
                for (int64_t chunk = 0; chunk < chunks; chunk++) {
                    const int64_t n = attended[m], first = chunk * SCORE_CHUNK;
                    const int64_t last = first + SCORE_CHUNK < n ? first + SCORE_CHUNK : n;
                    const float *q = qkv + m * qkv_width + g * group * dim;
                    const int64_t cache_row = s->cache_rows == 1 ? 0 : m;
                    const int64_t key_base = cache_row * layer->key_strides[0] + g * layer->key_strides[1];
                    const int32_t *own = columns + m * width;
                    float *score = scores + (m * heads + g * group) * stride;
                    for (int64_t j = first; j < last; j++) {
#if ATTEND_PREFETCH_COLUMNS > 0
                        if (j + ATTEND_PREFETCH_COLUMNS < n)
                            prefetch_cached(layer->keys, key_base + own[j + ATTEND_PREFETCH_COLUMNS] * layer->key_strides[2],
                                            dim, cell);
#endif
                        group_scores(q, layer->keys, key_base + own[j] * layer->key_strides[2], is_bf16, dim, group,
                                     scale, score + j, stride, row);
                    }
                }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * heads; task++) {  /* the new key after the attended columns */
            const int64_t m = task / heads, h = task % heads, g = h / group;
            const float *k_new = qkv + m * qkv_width + heads * dim + g * dim;
            attend_new_key(qkv + m * qkv_width + h * dim, k_new, k_new + kv_heads * dim, dim, scale,
                           scores + (m * heads + h) * stride, attended[m], out + m * heads * dim + h * dim);
        }
#pragma omp for collapse(3) schedule(static)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t g = 0; g < kv_heads; g++)
                for (int64_t pass = 0; pass < passes; pass++) {
                    const int64_t cache_row = s->cache_rows == 1 ? 0 : m;
                    const uint8_t *mask = s->mask + (s->mask_rows == 1 ? 0 : m) * width;
                    const int64_t value_base = cache_row * layer->value_strides[0] + g * layer->value_strides[1];
                    const float *score = scores + (m * heads + g * group) * stride;
                    float *o = out + m * heads * dim + g * group * dim;
                    const int64_t first = pass * wide, count = dim / 8 - first < wide ? dim / 8 - first : wide;
                    if (count == wide)
                        weigh_eights(layer->values, is_bf16, value_base, layer->value_strides[2], mask, width, score,
                                     stride, group, 1, 8 * first, dim, o);
                    else
                        for (int64_t e = first; e < first + count; e++)
                            weigh_eights(layer->values, is_bf16, value_base, layer->value_strides[2], mask, width,
                                         score, stride, group, 0, 8 * e, dim, o);
                }
    }
}
#endif

static void attend(const decoder_layer *layer, const step_shape *s, const float *qkv, int64_t qkv_width,
                   float *scratch, float *out) {
#ifdef __AVX2__
    if (attend_splits(s)) {
        attend_split(layer, s, qkv, qkv_width, scratch, out);
        return;
    }
#endif
    const int64_t heads = s->heads, kv_heads = s->kv_heads, dim = s->head_dim, width = s->width;
    const int64_t group = heads / kv_heads, stride = width + 1;
    const float scale = 1.0f / sqrtf((float)dim);
    const int is_bf16 = s->cache_is_bf16;
#pragma omp parallel num_threads(s->threads)
    {
        float *score = scratch + (int64_t)omp_get_thread_num() * attend_scratch(s);  /* (group, width + 1) */
        float *row = score + group * stride;  /* one widened key or value */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < s->rows * kv_heads; task++) {
            const int64_t m = task / kv_heads, g = task % kv_heads;
            const float *q = qkv + m * qkv_width + g * group * dim;  /* the group's queries, one after another */
            const float *k_new = qkv + m * qkv_width + heads * dim + g * dim;
            const float *v_new = k_new + kv_heads * dim;
            const int64_t cache_row = s->cache_rows == 1 ? 0 : m;
            const uint8_t *mask = s->mask + (s->mask_rows == 1 ? 0 : m) * width;
            const int64_t key_base = cache_row * layer->key_strides[0] + g * layer->key_strides[1];
            const int64_t value_base = cache_row * layer->value_strides[0] + g * layer->value_strides[1];
            int64_t attended = 0;
            const size_t cell = is_bf16 ? sizeof(uint16_t) : sizeof(float);
            for (int64_t c = 0; c < width; c++) {
#if ATTEND_PREFETCH_COLUMNS > 0
                prefetch_cached(layer->keys, key_base + (c + ATTEND_PREFETCH_COLUMNS) * layer->key_strides[2], dim, cell);
#endif
                if (!mask[c]) continue;
                group_scores(q, layer->keys, key_base + c * layer->key_strides[2], is_bf16, dim, group, scale,
                             score + attended, stride, row);
                attended++;
            }
            for (int64_t h = 0; h < group; h++)
                attend_new_key(q + h * dim, k_new, v_new, dim, scale, score + h * stride, attended,
                               out + m * heads * dim + (g * group + h) * dim);
            weigh_values(layer, s, mask, value_base, score, stride, group, row, out + m * heads * dim + g * group * dim);
        }
    }
}

/* x (B, hidden) float32 through `count` layers, in place; new_keys and new_values (layers, B, kv_heads,
 * head_dim) float32 (unused with `append`). Returns 0, or -1 when scratch cannot be allocated. */
int fusion_decode_layers(const decoder_layer *layers, int64_t count, const step_shape *s, float *x,
                         float *new_keys, float *new_values) {
    const int64_t rows = s->rows, hidden = s->hidden, dim = s->head_dim;
    const int64_t q_width = s->heads * dim, kv_width = s->kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    const int64_t inter = s->intermediate, widest = inter > hidden ? inter : hidden;
    CLOCK_START();
    int64_t columns = 1;
    for (int64_t l = 0; l < count; l++)
        for (int p = 0; p < PROJECTIONS; p++)
            if (layers[l].lora[p].columns > columns) columns = layers[l].lora[p].columns;
    float *h = malloc((size_t)(rows * widest) * sizeof(float));
    float *qkv = malloc((size_t)(rows * qkv_width) * sizeof(float));
    float *attn = malloc((size_t)(rows * q_width) * sizeof(float));
    float *gate_up = malloc((size_t)(rows * 2 * inter) * sizeof(float));
    float *delta = malloc((size_t)(rows * hidden) * sizeof(float));
    float *scratch = malloc((size_t)(s->threads * attend_scratch(s) + attend_shared_scratch(s)) * sizeof(float));
    float *t = malloc((size_t)(rows * columns) * sizeof(float));
    quantized_rows q = {0};
    int status = -1;
    if (alloc_rows(rows, widest, &q) || !h || !qkv || !attn || !gate_up || !delta || !scratch || !t)
        goto done;
    CLOCK_LAP(CLOCK_SETUP);

    for (int64_t l = 0; l < count; l++) {
        const decoder_layer *layer = layers + l;
        rms_norm(x, layer->input_norm, rows, hidden, s->eps, h);
        CLOCK_LAP(CLOCK_NORMS);
        project(h, rows, &layer->projection[QKV], layer->qkv_bias, &layer->lora[QKV], s->adapter_rows, &q, t, qkv,
                s->threads);
        CLOCK_LAP(CLOCK_PRODUCTS);
        for (int64_t m = 0; m < rows; m++) {
            float *row = qkv + m * qkv_width;
            for (int64_t head = 0; head < s->heads + s->kv_heads; head++)  /* the queries' heads, then the keys' */
                rotate(row + head * dim, s->cos + m * dim, s->sin + m * dim, dim);
            if (s->append) {
                const int64_t cache_row = s->cache_rows == 1 ? 0 : m;
                const int64_t column = s->columns == NULL ? s->width : s->columns[m];
                for (int64_t g = 0; g < s->kv_heads; g++) {
                    store_cached((void *)layer->keys, cache_row * layer->key_strides[0] + g * layer->key_strides[1]
                                 + column * layer->key_strides[2], row + q_width + g * dim, dim, s->cache_is_bf16);
                    store_cached((void *)layer->values, cache_row * layer->value_strides[0]
                                 + g * layer->value_strides[1] + column * layer->value_strides[2],
                                 row + q_width + kv_width + g * dim, dim, s->cache_is_bf16);
                }
                continue;
            }
            memcpy(new_keys + (l * rows + m) * kv_width, row + q_width, (size_t)kv_width * sizeof(float));
            memcpy(new_values + (l * rows + m) * kv_width, row + q_width + kv_width, (size_t)kv_width * sizeof(float));
        }
        CLOCK_LAP(CLOCK_ROTARY_KV);
        attend(layer, s, qkv, qkv_width, scratch, attn);
        CLOCK_LAP(CLOCK_ATTENTION);
        project(attn, rows, &layer->projection[O], NULL, &layer->lora[O], s->adapter_rows, &q, t, delta, s->threads);
        CLOCK_LAP(CLOCK_PRODUCTS);
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += delta[i];
        CLOCK_LAP(CLOCK_RESIDUAL);

        rms_norm(x, layer->post_norm, rows, hidden, s->eps, h);
        CLOCK_LAP(CLOCK_NORMS);
        project(h, rows, &layer->projection[GATE_UP], NULL, &layer->lora[GATE_UP], s->adapter_rows, &q, t, gate_up,
                s->threads);
        CLOCK_LAP(CLOCK_PRODUCTS);
        for (int64_t m = 0; m < rows; m++) silu_times(gate_up + m * 2 * inter, gate_up + m * 2 * inter + inter, inter,
                                                      h + m * inter);
        CLOCK_LAP(CLOCK_ACTIVATION);
        project(h, rows, &layer->projection[DOWN], NULL, &layer->lora[DOWN], s->adapter_rows, &q, t, delta, s->threads);
        CLOCK_LAP(CLOCK_PRODUCTS);
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += delta[i];
        CLOCK_LAP(CLOCK_RESIDUAL);
    }
    status = 0;
done:
    free(h);
    free(qkv);
    free(attn);
    free(gate_up);
    free(delta);
    free(scratch);
    free(t);
    free_rows(&q);
    return status;
}
