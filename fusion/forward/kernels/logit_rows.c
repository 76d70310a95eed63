/* The route rule's passes over the vocabulary (fusion/fuse/router.py), for rows of float32 logits: each expert's
 * statistics in two reads of its row, and the experts' mixture in one. Torch runs each as a dozen operators
 * over the (experts, rows, vocabulary) logits, each a pass of its own. */

#ifdef __AVX2__
/* ln x of 8 positive normal floats (Cephes' logf: the mantissa's polynomial, about an ulp). */
static __m256 log8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256i bits = _mm256_castps_si256(x);
    __m256 exponent = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
    /* the mantissa in [0.5, 1) */
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                   _mm256_castps_si256(_mm256_set1_ps(0.5f))));
    const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    exponent = _mm256_sub_ps(exponent, _mm256_and_ps(one, small));
    m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(m, small)), one);  /* m - 1, or 2m - 1 below sqrt(1/2) */
    const __m256 z = _mm256_mul_ps(m, m);
    __m256 y = _mm256_set1_ps(7.0376836292e-2f);
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174e-1f));
    y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
    y = _mm256_fmadd_ps(exponent, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
    return _mm256_fmadd_ps(exponent, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}
#endif

/* Row r of `rows` rows of `width` logits (rows * width floats): best_ids[r], the first id holding the row's
 * maximum; best[r], that maximum; runner_up[r], the largest other logit less it (0 where the maximum ties);
 * log_total[r] = ln sum e^y and entropy[r] = log_total[r] - sum e^y y / sum e^y, y = max(z - best, floor). */
void fusion_logit_statistics(const float *logits, int64_t rows, int64_t width, float floor, int threads,
                             int64_t *best_ids, float *best, float *runner_up, float *log_total, float *entropy) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *z = logits + r * width;
        float first = -INFINITY, second = -INFINITY;  /* the largest two, a tie counted twice */
        int64_t i = 0;
#ifdef __AVX2__
        __m256 top = _mm256_set1_ps(-INFINITY), next = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= width; i += 8) {
            __m256 v = _mm256_loadu_ps(z + i);
            next = _mm256_max_ps(next, _mm256_min_ps(top, v));
            top = _mm256_max_ps(top, v);
        }
        float tops[8], nexts[8];
        _mm256_storeu_ps(tops, top);
        _mm256_storeu_ps(nexts, next);
        for (int lane = 0; lane < 8; lane++) {
            for (int k = 0; k < 2; k++) {
                float v = k == 0 ? tops[lane] : nexts[lane];
                if (v > first) { second = first; first = v; }
                else if (v > second) second = v;
            }
        }
#endif
        for (; i < width; i++) {
            if (z[i] > first) { second = first; first = z[i]; }
            else if (z[i] > second) second = z[i];
        }
        int64_t id = 0;
        while (id < width && z[id] != first) id++;
        float total = 0, weighted = 0;
        i = 0;
#ifdef __AVX2__
        const __m256 shift = _mm256_set1_ps(first), lowest = _mm256_set1_ps(floor);
        __m256 totals = _mm256_setzero_ps(), weighteds = _mm256_setzero_ps();
        for (; i + 8 <= width; i += 8) {
            __m256 y = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(z + i), shift), lowest);
            __m256 e = exp8(y);
            totals = _mm256_add_ps(totals, e);
            weighteds = _mm256_fmadd_ps(e, y, weighteds);
        }
        total = horizontal_sum(totals);
        weighted = horizontal_sum(weighteds);
#endif
        for (; i < width; i++) {
            float y = z[i] - first < floor ? floor : z[i] - first, e = expf(y);
            total += e;
            weighted += e * y;
        }
        best_ids[r] = id;
        best[r] = first;
        runner_up[r] = second - first;
        log_total[r] = logf(total);
        entropy[r] = log_total[r] - weighted / total;
    }
}

/* out (rows, width) = ln sum_e e^(a_e), a_e = log_weights[e, r] + logits[e, r, :] - normalizers[e, r], over
 * `experts` experts (logits (experts, rows, width)), at most MIXTURE_MAX; an expert of weight 0 (log_weights
 * -inf) adds nothing, and an id every expert rules out (logits -inf) stays -inf. With `comp_inputs` (rows,
 * comp_width), the route rule's complementary logit is added in the same pass: out[r, v] += comp_scale[r] *
 * comp_bias[v] + sum_k comp_inputs[r, k] * comp_weight[k, v], comp_weight (comp_width, width). */
#define MIXTURE_MAX 16
void fusion_mixture(const float *logits, const float *log_weights, const float *normalizers, int64_t experts,
                    int64_t rows, int64_t width, int threads, const float *comp_inputs, int64_t comp_width,
                    const float *comp_weight, const float *comp_bias, const float *comp_scale, float *out) {
    enum { CHUNK = 2048 };
    const int64_t chunks = (width + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < rows * chunks; task++) {
        const int64_t r = task / chunks, start = (task % chunks) * CHUNK;
        const int64_t stop = start + CHUNK < width ? start + CHUNK : width;
        float *o = out + r * width;
        int64_t i = start;
#ifdef __AVX2__
        for (; i + 8 <= stop; i += 8) {
            __m256 a[MIXTURE_MAX], top = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
            int64_t used = 0;
            for (int64_t e = 0; e < experts && used < MIXTURE_MAX; e++) {
                const float lw = log_weights[e * rows + r];
                if (lw == -INFINITY) continue;
                a[used] = _mm256_add_ps(_mm256_loadu_ps(logits + (e * rows + r) * width + i),
                                        _mm256_set1_ps(lw - normalizers[e * rows + r]));
                top = _mm256_max_ps(top, a[used++]);
            }
            for (int64_t e = 0; e < used; e++) total = _mm256_add_ps(total, exp8(_mm256_sub_ps(a[e], top)));
            /* an id every expert rules out (-inf) stays -inf */
            const __m256 excluded = _mm256_cmp_ps(top, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
            __m256 fused = _mm256_blendv_ps(_mm256_add_ps(top, log8(total)), top, excluded);
            if (comp_inputs) {
                fused = _mm256_fmadd_ps(_mm256_set1_ps(comp_scale[r]), _mm256_loadu_ps(comp_bias + i), fused);
                for (int64_t k = 0; k < comp_width; k++)
                    fused = _mm256_fmadd_ps(_mm256_set1_ps(comp_inputs[r * comp_width + k]),
                                            _mm256_loadu_ps(comp_weight + k * width + i), fused);
            }
            _mm256_storeu_ps(o + i, fused);
        }
#endif
        for (; i < stop; i++) {
            float top = -INFINITY, total = 0;
            for (int64_t e = 0; e < experts; e++) {
                const float lw = log_weights[e * rows + r];
                if (lw == -INFINITY) continue;
                const float a = lw + logits[(e * rows + r) * width + i] - normalizers[e * rows + r];
                if (a > top) top = a;
            }
            for (int64_t e = 0; e < experts; e++) {
                const float lw = log_weights[e * rows + r];
                if (lw == -INFINITY) continue;
                total += expf(lw + logits[(e * rows + r) * width + i] - normalizers[e * rows + r] - top);
            }
            o[i] = top == -INFINITY ? top : top + logf(total);
            if (comp_inputs) {
                o[i] = fmaf(comp_scale[r], comp_bias[i], o[i]);
                for (int64_t k = 0; k < comp_width; k++) o[i] = fmaf(comp_inputs[r * comp_width + k], comp_weight[k * width + i], o[i]);
            }
        }
    }
}

/* The route rule's router from its inputs to its outputs for a few rows (fusion/fuse/router.py's `Router`: the
 * context features, the body, the route's weights, the fail-safe gate and the complementary layer's input), in
 * float32, as torch computes them in eager decoding; at a step's one to a few rows torch dispatches some thirty
 * small operators for this, which cost more than their arithmetic. Every matrix row-major float32, as the
 * module holds it (weight (out, in)). */
typedef struct {
    int64_t experts, features, embed_dim, hidden, comp_width;  /* comp_width 0: no complementary layer */
    int64_t context, windows[4], window_count;  /* windows: up to ROUTER_MAX_WINDOWS */
    int64_t vocabulary;
    const float *embed;                      /* (vocabulary, embed_dim) */
    const float *norm_weight, *norm_bias;    /* (inputs,): the body's LayerNorm */
    float norm_eps;
    const float *w1, *b1, *w2, *b2;          /* (hidden, inputs), (hidden,), (hidden, hidden), (hidden,) */
    const float *route_weight, *route_bias;  /* (experts, hidden), (experts,) */
    const float *comp_down;                  /* (comp_width, hidden), or NULL: the layer's input is h */
    const float *gate_mean, *gate_whiten;    /* (inputs,), (inputs, inputs), or NULL: no gate */
    float gate_limit;
    int64_t generalist;
} router_params;

/* y (n_out,) = W x + b, W (n_out, n_in) row-major: each output's sum in `dot`'s order. */
static void linear_row(const float *w, const float *b, const float *x, int64_t n_in, int64_t n_out, float *y) {
    for (int64_t o = 0; o < n_out; o++) y[o] = dot(w + o * n_in, x, n_in) + (b != NULL ? b[o] : 0.0f);
}

static float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

/* For each of `rows` rows: features (rows, features) (the logit statistics), context (rows, context) recent
 * ids (-1: none), allowed (experts, rows) (0: the request left the expert out) -> weights (experts, rows), the
 * complementary logit's share keep (rows,) (1 - the gate's pull; 1 without a gate or `fail_safe`), and the
 * complementary layer's input times keep, comp (rows, comp_width). Returns 0; -1 when the router is wider
 * than this function's scratch, -2 when a context id lies outside the embedding (nothing read past it). */
#define ROUTER_MAX_WIDTH 1024   /* fusion/forward/native_kernels.py's ROUTER_MAX_* name the same bounds */
#define ROUTER_MAX_EXPERTS 64
#define ROUTER_MAX_WINDOWS 4
int fusion_router_head(const router_params *p, const float *features, const int64_t *context, const uint8_t *allowed,
                       int64_t rows, int fail_safe, float *weights, float *keep, float *comp) {
    const int64_t inputs = p->features + p->embed_dim * (1 + p->window_count);
    if (inputs > ROUTER_MAX_WIDTH || p->hidden > ROUTER_MAX_WIDTH || p->experts > ROUTER_MAX_EXPERTS
        || p->window_count > ROUTER_MAX_WINDOWS)
        return -1;
    float x[ROUTER_MAX_WIDTH], normed[ROUTER_MAX_WIDTH], h1[ROUTER_MAX_WIDTH], h[ROUTER_MAX_WIDTH];
    float whitened[ROUTER_MAX_WIDTH], route[ROUTER_MAX_EXPERTS];
    for (int64_t i = 0; i < rows * p->context; i++)
        if (context[i] >= p->vocabulary) return -2;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t *ids = context + b * p->context;
        memcpy(x, features + b * p->features, (size_t)p->features * sizeof(float));
        /* the last id's embedding, then each window's mean embedding over its valid ids (at least 1) */
        float *part = x + p->features;
        const int64_t last = ids[p->context - 1];
        for (int64_t j = 0; j < p->embed_dim; j++) part[j] = last >= 0 ? p->embed[last * p->embed_dim + j] : 0.0f;
        for (int64_t w = 0; w < p->window_count; w++) {
            float *mean = part + (1 + w) * p->embed_dim;
            int64_t valid = 0;
            for (int64_t j = 0; j < p->embed_dim; j++) mean[j] = 0.0f;
            for (int64_t c = p->context - p->windows[w]; c < p->context; c++) {
                if (ids[c] < 0) continue;
                valid++;
                for (int64_t j = 0; j < p->embed_dim; j++) mean[j] += p->embed[ids[c] * p->embed_dim + j];
            }
            const float count = valid > 0 ? (float)valid : 1.0f;
            for (int64_t j = 0; j < p->embed_dim; j++) mean[j] /= count;
        }
        /* the body: LayerNorm, linear, GELU, linear, GELU */
        float mean = 0.0f, variance = 0.0f;
        for (int64_t i = 0; i < inputs; i++) mean += x[i];
        mean /= (float)inputs;
        for (int64_t i = 0; i < inputs; i++) variance += (x[i] - mean) * (x[i] - mean);
        variance /= (float)inputs;
        const float inverse = 1.0f / sqrtf(variance + p->norm_eps);
        for (int64_t i = 0; i < inputs; i++) normed[i] = (x[i] - mean) * inverse * p->norm_weight[i] + p->norm_bias[i];
        linear_row(p->w1, p->b1, normed, inputs, p->hidden, h1);
        for (int64_t o = 0; o < p->hidden; o++) h1[o] = gelu(h1[o]);
        linear_row(p->w2, p->b2, h1, p->hidden, p->hidden, h);
        for (int64_t o = 0; o < p->hidden; o++) h[o] = gelu(h[o]);
        /* the route's softmax over the allowed experts (decoder_step.c's softmax: -inf weighs 0) */
        linear_row(p->route_weight, p->route_bias, h, p->hidden, p->experts, route);
        for (int64_t e = 0; e < p->experts; e++)
            if (!allowed[e * rows + b]) route[e] = -INFINITY;
        softmax(route, p->experts);
        for (int64_t e = 0; e < p->experts; e++) weights[e * rows + b] = route[e];
        /* the gate: pull towards the generalist as the inputs lie further from training's */
        float pull = 0.0f;
        if (fail_safe && p->gate_whiten != NULL) {
            for (int64_t i = 0; i < inputs; i++) normed[i] = x[i] - p->gate_mean[i];
            for (int64_t j = 0; j < inputs; j++) whitened[j] = 0.0f;
            for (int64_t i = 0; i < inputs; i++)  /* (x - mean) @ whiten, row i of whiten scaled by input i */
                for (int64_t j = 0; j < inputs; j++) whitened[j] += normed[i] * p->gate_whiten[i * inputs + j];
            float distance = 0.0f;
            for (int64_t j = 0; j < inputs; j++) distance += whitened[j] * whitened[j];
            distance /= (float)inputs;
            pull = distance / p->gate_limit - 1.0f;
            pull = pull < 0.0f ? 0.0f : pull > 1.0f ? 1.0f : pull;
            if (!allowed[p->generalist * rows + b]) pull = 0.0f;  /* never towards a generalist left out */
            for (int64_t e = 0; e < p->experts; e++)
                weights[e * rows + b] = (1.0f - pull) * weights[e * rows + b] + (e == p->generalist ? pull : 0.0f);
        }
        keep[b] = 1.0f - pull;
        if (p->comp_width > 0) {
            if (p->comp_down != NULL)
                linear_row(p->comp_down, NULL, h, p->hidden, p->comp_width, comp + b * p->comp_width);
            else
                memcpy(comp + b * p->comp_width, h, (size_t)p->hidden * sizeof(float));
            for (int64_t j = 0; j < p->comp_width; j++) comp[b * p->comp_width + j] *= keep[b];
        }
    }
    return 0;
}
