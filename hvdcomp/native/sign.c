/* Native CPU kernels of the sign methods: signSGD with majority vote (Bernstein et al., ICML 2018 /
 * ICLR 2019) and EF-signSGD (Karimireddy et al., ICML 2019). sign(0) = +1 everywhere; a NaN
 * element counts as negative (bit 0), as `x >= 0` does in torch. */
#include <stdlib.h>

#include "common.h"

/* bit i = [x_i >= 0], 1 bit per element (little-endian within each byte); if abs_sum is given,
 * *abs_sum = Σ|x| in float64, summed in a fixed order. Returns -1 if out of memory. */
HVD_EXPORT int hvd_sign_bits(const float *x, int64_t n, uint8_t *packed, double *abs_sum,
                             int32_t nthreads) {
    if (abs_sum) *abs_sum = 0.0;
    if (n <= 0) return 0;
    const int64_t nchunks = (n + HVD_CHUNK - 1) / HVD_CHUNK;
    double *part = abs_sum ? (double *)malloc((size_t)nchunks * sizeof(double)) : NULL;
    if (abs_sum && !part) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t c0 = ch * HVD_CHUNK, c1 = hvd_min64(n, c0 + HVD_CHUNK), m = c1 - c0;
        const float *xx = x + c0;
        uint8_t *p = packed + c0 / 8;
        const int64_t groups = m / 8;
        for (int64_t q = 0; q < groups; q++) {
            uint8_t b = 0;
            for (int k = 0; k < 8; k++) b |= (uint8_t)((xx[8 * q + k] >= 0.0f) << k);
            p[q] = b;
        }
        if (m > 8 * groups) {
            uint8_t b = 0;
            for (int k = 0; k < m - 8 * groups; k++) b |= (uint8_t)((xx[8 * groups + k] >= 0.0f) << k);
            p[groups] = b;
        }
        if (part) part[ch] = hvd_sum_abs_f64(xx, m);
    }
    if (part) {
        double total = 0.0;
        for (int64_t ch = 0; ch < nchunks; ch++) total += part[ch];
        *abs_sum = total;
        free(part);
    }
    return 0;
}

/* votes_i = +1 if x_i >= 0 else -1 (int32). */
HVD_EXPORT void hvd_sign_votes(const float *x, int64_t n, int32_t *votes, int32_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) votes[i] = x[i] >= 0.0f ? 1 : -1;
}

/* out = Σ_w (bit_w ? f_w : -f_w); with decrement != 0: out -= f_0·(2·bit_0 - 1) (W must be 1). */
HVD_EXPORT void hvd_scaled_sign_aggregate(int32_t W, const float *f, const uint8_t *const *packed,
                                          int64_t n, float *out, int32_t decrement,
                                          int32_t nthreads) {
    if (n <= 0) return;
    const int64_t nchunks = (n + HVD_CHUNK - 1) / HVD_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        uint8_t codes[HVD_CHUNK];
        const int64_t c0 = ch * HVD_CHUNK, c1 = hvd_min64(n, c0 + HVD_CHUNK), m = c1 - c0;
        float *o = out + c0;
        for (int32_t w = 0; w < W; w++) {
            hvd_unpack(packed[w] + c0 / 8, m, 1, codes);
            const float pos = f[w], neg = -f[w];
            if (decrement)
                for (int64_t t = 0; t < m; t++) o[t] -= codes[t] ? pos : neg;
            else if (w == 0)
                for (int64_t t = 0; t < m; t++) o[t] = 0.0f + (codes[t] ? pos : neg);
            else
                for (int64_t t = 0; t < m; t++) o[t] += codes[t] ? pos : neg;
        }
    }
}

/* Majority vote: out = +1 if Σ_w v_w >= 0 else -1, with v = ±1 from 1-bit payloads (votes == NULL)
 * or int32 vote counts (bits == NULL), W payloads. */
HVD_EXPORT void hvd_majority(int32_t W, const uint8_t *const *bits, const int32_t *const *votes,
                             int64_t n, float *out, int32_t nthreads) {
    if (n <= 0) return;
    const int64_t nchunks = (n + HVD_CHUNK - 1) / HVD_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        uint8_t codes[HVD_CHUNK];
        int32_t total[HVD_CHUNK];
        const int64_t c0 = ch * HVD_CHUNK, c1 = hvd_min64(n, c0 + HVD_CHUNK), m = c1 - c0;
        for (int64_t t = 0; t < m; t++) total[t] = 0;
        for (int32_t w = 0; w < W; w++) {
            if (bits) {
                hvd_unpack(bits[w] + c0 / 8, m, 1, codes);
                for (int64_t t = 0; t < m; t++) total[t] += 2 * (int32_t)codes[t] - 1;
            } else {
                const int32_t *v = votes[w] + c0;
                for (int64_t t = 0; t < m; t++) total[t] += v[t];
            }
        }
        float *o = out + c0;
        for (int64_t t = 0; t < m; t++) o[t] = total[t] >= 0 ? 1.0f : -1.0f;
    }
}

/* Σ|x| in float64 of each of nseg tensors back to back in x (segment j: sizes[j] elements) into
 * sums[j], each summed as hvd_sign_bits sums one tensor (chunk by chunk, in order). Returns -1 if
 * out of memory. */
HVD_EXPORT int hvd_abs_sums_segments(const float *x, int64_t nseg, const int64_t *sizes, double *sums,
                                     int32_t nthreads) {
    if (nseg <= 0) return 0;
    int64_t *start = hvd_units(nseg, sizes, HVD_CHUNK);
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * sizeof(int64_t));
    double *part = start ? (double *)malloc((size_t)(start[nseg] + 1) * sizeof(double)) : NULL;
    if (!start || !off || !part) { free(start); free(off); free(part); return -1; }
    HVD_PREFIX(off, nseg, sizes, n);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < start[nseg]; t++) {
        const int64_t j = hvd_unit_segment(start, nseg, t);
        const int64_t c0 = (t - start[j]) * HVD_CHUNK, c1 = hvd_min64(sizes[j], c0 + HVD_CHUNK);
        part[t] = hvd_sum_abs_f64(x + off[j] + c0, c1 - c0);
    }
    for (int64_t j = 0; j < nseg; j++) {
        double total = 0.0;
        for (int64_t t = start[j]; t < start[j + 1]; t++) total += part[t];
        sums[j] = total;
    }
    free(start);
    free(off);
    free(part);
    return 0;
}

/* hvd_scaled_sign_aggregate of nseg tensors back to back (segment j: sizes[j] elements), each
 * with its own factors f[w·nseg + j]; the bits are those of the whole buffer (element i: bit i of
 * packed[w]). With decrement != 0: out -= f[j]·(2·bit - 1) (W must be 1). Returns -1 if out of
 * memory. */
HVD_EXPORT int hvd_scaled_sign_aggregate_segments(int32_t W, const float *f, const uint8_t *const *packed,
                                                  int64_t nseg, const int64_t *sizes, float *out,
                                                  int32_t decrement, int32_t nthreads) {
    if (nseg <= 0) return 0;
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * sizeof(int64_t));
    if (!off) return -1;
    HVD_PREFIX(off, nseg, sizes, n);
    const int64_t total = off[nseg], nchunks = (total + HVD_CHUNK - 1) / HVD_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        uint8_t codes[HVD_CHUNK];
        const int64_t c0 = ch * HVD_CHUNK, c1 = hvd_min64(total, c0 + HVD_CHUNK), m = c1 - c0;
        int64_t first = 0, hi = nseg - 1;  /* the last segment starting at or before c0 */
        while (first < hi) {
            const int64_t mid = (first + hi + 1) / 2;
            if (off[mid] <= c0) first = mid; else hi = mid - 1;
        }
        for (int32_t w = 0; w < W; w++) {
            hvd_unpack(packed[w] + c0 / 8, m, 1, codes);
            for (int64_t j = first; j < nseg && off[j] < c1; j++) {
                const int64_t a = off[j] > c0 ? off[j] : c0, b = off[j + 1] < c1 ? off[j + 1] : c1;
                const float pos = f[w * nseg + j], neg = -f[w * nseg + j];
                const uint8_t *cc = codes + (a - c0);
                float *o = out + a;
                if (decrement)
                    for (int64_t t = 0; t < b - a; t++) o[t] -= cc[t] ? pos : neg;
                else if (w == 0)
                    for (int64_t t = 0; t < b - a; t++) o[t] = 0.0f + (cc[t] ? pos : neg);
                else
                    for (int64_t t = 0; t < b - a; t++) o[t] += cc[t] ? pos : neg;
            }
        }
    }
    free(off);
    return 0;
}
