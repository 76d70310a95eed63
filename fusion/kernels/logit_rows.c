/* The route rule's passes over the vocabulary (fusion/router.py), for rows of float32 logits: each expert's
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
