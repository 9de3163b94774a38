/* Native CPU kernels of the stochastic quantizers: QSGD (Alistarh et al., NeurIPS 2017) and
 * TernGrad (Wen et al., NeurIPS 2017). Python wrappers and the exact semantics: qsgd.py,
 * terngrad.py and native/__init__.py. All inputs are contiguous float32; codes are packed at
 * `bits` bits in the little-endian bit stream of bitpack.py (8-bit codes are plain bytes). */
#include <stdlib.h>

#include "common.h"

/* ---- QSGD -------------------------------------------------------------------------------------- */

/* codes of one bucket segment: level = floor(r) + [u < r - floor(r)], r = min(s·|x|/scale, s);
 * code = s + sign(x)·level. NaN magnitudes give r = s (the scale is NaN then, so is the decode). */
static inline void qsgd_codes(const float *x, const float *u, int64_t m, float safe, float sf,
                              int32_t s, uint8_t *codes) {
    for (int64_t t = 0; t < m; t++) {
        float r = fabsf(x[t]) / safe * sf;
        r = r < sf ? r : sf;
        int32_t low = (int32_t)r;
        int32_t level = low + (u[t] < r - (float)low);
        codes[t] = (uint8_t)(x[t] < 0.0f ? s - level : s + level);
    }
}

static inline float qsgd_scale(const float *x, int64_t m, int32_t use_max) {
    if (use_max) return hvd_max_abs(x, m);
    double norm = sqrt(hvd_sum_sq_f64(x, m));           /* float64: never inf for finite input */
    return norm > (double)FLT_MAX ? FLT_MAX : (float)norm; /* NaN stays NaN */
}

/* Blocks of whole buckets, a multiple of 8 buckets each, so that a block starts at a multiple of
 * 8 elements (a whole packed group) and its scales are computed while its data is in cache. */
static int64_t qsgd_block_buckets(int64_t d) {
    int64_t bb = (HVD_CHUNK + d - 1) / d;
    return (bb + 7) / 8 * 8;
}

/* Block `blk` (buckets [blk·bb, (blk+1)·bb)) of the QSGD encode of x (n elements): its scales,
 * then its codes, chunk by chunk, with the uniforms of (key, chunk start). */
static inline void qsgd_encode_block(const float *x, int64_t n, int64_t d, int32_t s, int32_t use_max,
                                     int32_t bits, uint64_t key, float *scales, uint8_t *packed,
                                     int64_t blk, int64_t bb) {
    uint8_t codes[HVD_CHUNK];
    float u[HVD_CHUNK];
    const int64_t nb = (n + d - 1) / d;
    const float sf = (float)s;
    const int64_t b0 = blk * bb, b1 = hvd_min64(nb, b0 + bb);
    for (int64_t j = b0; j < b1; j++) {
        const int64_t start = j * d;
        scales[j] = qsgd_scale(x + start, hvd_min64(n, start + d) - start, use_max);
    }
    const int64_t e1 = hvd_min64(n, b1 * d);
    int64_t j = b0;
    for (int64_t c0 = b0 * d; c0 < e1; c0 += HVD_CHUNK) {
        const int64_t c1 = hvd_min64(e1, c0 + HVD_CHUNK);
        hvd_uniforms(key, c0, c1 - c0, u);
        for (int64_t i = c0; i < c1;) {
            while ((j + 1) * d <= i) j++;
            const int64_t stop = hvd_min64(c1, (j + 1) * d);
            const float sc = scales[j], safe = sc > 0.0f ? sc : 1.0f;
            qsgd_codes(x + i, u + (i - c0), stop - i, safe, sf, s, codes + (i - c0));
            i = stop;
        }
        hvd_pack(codes, c1 - c0, bits, packed + c0 / 8 * bits);
    }
}

static inline int qsgd_bad(int64_t d, int32_t s, int32_t bits) {
    return bits < 1 || bits > 8 || d < 1 || s < 1 || 2 * (int64_t)s >= (1 << bits);
}

HVD_EXPORT int hvd_qsgd_encode(const float *x, int64_t n, int64_t d, int32_t s, int32_t use_max,
                               int32_t bits, uint64_t key, float *scales, uint8_t *packed,
                               int32_t nthreads) {
    if (n <= 0) return 0;
    if (qsgd_bad(d, s, bits)) return -1;
    const int64_t nb = (n + d - 1) / d, bb = qsgd_block_buckets(d), nblocks = (nb + bb - 1) / bb;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t blk = 0; blk < nblocks; blk++)
        qsgd_encode_block(x, n, d, s, use_max, bits, key, scales, packed, blk, bb);
    return 0;
}

/* hvd_qsgd_encode of each of nseg tensors laid back to back in x (segment j: sizes[j] elements,
 * keys[j]), in one call: segment j's scales follow those of the segments before it (ceil(n/d)
 * each), and so do its codes (ceil(n·bits/8) bytes each). Returns -1 for bad settings, -2 if out
 * of memory. */
HVD_EXPORT int hvd_qsgd_encode_segments(const float *x, int64_t nseg, const int64_t *sizes,
                                        const uint64_t *keys, int64_t d, int32_t s, int32_t use_max,
                                        int32_t bits, float *scales, uint8_t *packed, int32_t nthreads) {
    if (nseg <= 0) return 0;
    if (qsgd_bad(d, s, bits)) return -1;
    const int64_t bb = qsgd_block_buckets(d);
    int64_t *start = hvd_units(nseg, sizes, bb * d);
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * 3 * sizeof(int64_t));
    if (!start || !off) { free(start); free(off); return -2; }
    int64_t *soff = off + (nseg + 1), *boff = off + 2 * (nseg + 1);
    HVD_PREFIX(off, nseg, sizes, n);
    HVD_PREFIX(soff, nseg, sizes, (n + d - 1) / d);
    HVD_PREFIX(boff, nseg, sizes, (n * bits + 7) / 8);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < start[nseg]; t++) {
        const int64_t j = hvd_unit_segment(start, nseg, t);
        qsgd_encode_block(x + off[j], sizes[j], d, s, use_max, bits, keys[j], scales + soff[j],
                          packed + boff[j], t - start[j], bb);
    }
    free(start);
    free(off);
    return 0;
}

/* Chunk c (HVD_CHUNK elements) of the QSGD aggregate of W payloads of one tensor of n elements
 * whose scales start at scales[w] + so and codes at packed[w] + bo. */
static inline void qsgd_aggregate_chunk(int32_t W, const float *const *scales,
                                        const uint8_t *const *packed, int64_t so, int64_t bo,
                                        int64_t n, int64_t d, int32_t s, int32_t bits, float *out,
                                        int64_t c) {
    uint8_t codes[HVD_CHUNK];
    const float denom = (float)((int64_t)s * W);
    const int64_t c0 = c * HVD_CHUNK, c1 = hvd_min64(n, c0 + HVD_CHUNK);
    float *o = out + c0;
    for (int32_t w = 0; w < W; w++) {
        hvd_unpack(packed[w] + bo + c0 / 8 * bits, c1 - c0, bits, codes);
        for (int64_t i = c0; i < c1;) {
            const int64_t j = i / d, stop = hvd_min64(c1, (j + 1) * d);
            const float f = scales[w][so + j] / denom;
            const uint8_t *cc = codes + (i - c0);
            float *oo = o + (i - c0);
            const int64_t m = stop - i;
            if (w == 0)
                for (int64_t t = 0; t < m; t++) oo[t] = 0.0f + f * (float)((int32_t)cc[t] - s);
            else
                for (int64_t t = 0; t < m; t++) oo[t] += f * (float)((int32_t)cc[t] - s);
            i = stop;
        }
    }
}

/* out = Σ_w scale_w[bucket]/(s·W) · (code_w - s), one write of each output element; W >= 1. */
HVD_EXPORT int hvd_qsgd_aggregate(int32_t W, const float *const *scales,
                                  const uint8_t *const *packed, int64_t n, int64_t d, int32_t s,
                                  int32_t bits, float *out, int32_t nthreads) {
    if (n <= 0) return 0;
    if (W < 1 || bits < 1 || bits > 8 || d < 1 || s < 1) return -1;
    const int64_t nchunks = (n + HVD_CHUNK - 1) / HVD_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < nchunks; c++)
        qsgd_aggregate_chunk(W, scales, packed, 0, 0, n, d, s, bits, out, c);
    return 0;
}

/* hvd_qsgd_aggregate of each segment of payloads laid out as hvd_qsgd_encode_segments writes them,
 * into out (the segments back to back). Returns -1 for bad settings, -2 if out of memory. */
HVD_EXPORT int hvd_qsgd_aggregate_segments(int32_t W, const float *const *scales,
                                           const uint8_t *const *packed, int64_t nseg,
                                           const int64_t *sizes, int64_t d, int32_t s, int32_t bits,
                                           float *out, int32_t nthreads) {
    if (nseg <= 0) return 0;
    if (W < 1 || bits < 1 || bits > 8 || d < 1 || s < 1) return -1;
    int64_t *start = hvd_units(nseg, sizes, HVD_CHUNK);
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * 3 * sizeof(int64_t));
    if (!start || !off) { free(start); free(off); return -2; }
    int64_t *soff = off + (nseg + 1), *boff = off + 2 * (nseg + 1);
    HVD_PREFIX(off, nseg, sizes, n);
    HVD_PREFIX(soff, nseg, sizes, (n + d - 1) / d);
    HVD_PREFIX(boff, nseg, sizes, (n * bits + 7) / 8);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < start[nseg]; t++) {
        const int64_t j = hvd_unit_segment(start, nseg, t);
        qsgd_aggregate_chunk(W, scales, packed, soff[j], boff[j], sizes[j], d, s, bits, out + off[j],
                             t - start[j]);
    }
    free(start);
    free(off);
    return 0;
}

/* ---- TernGrad ------------------------------------------------------------------------------------ */

#define HVD_MOMENT_CHUNK 65536

/* Chunk c (HVD_MOMENT_CHUNK elements) of hvd_moments: part[0..2] = Σ(x - K), Σ(x - K)², max|x|
 * (NaN if any NaN). */
static inline void moments_chunk(const float *x, int64_t n, double K, int64_t c, double *part) {
    const int64_t c0 = c * HVD_MOMENT_CHUNK, c1 = hvd_min64(n, c0 + HVD_MOMENT_CHUNK);
    double a = 0, b = 0;
    float mx = 0.0f;
    int nan = 0;
    int64_t i = c0;
#ifdef __SSE2__
    /* sums in float64, max|x| and NaN in the same pass */
    const __m128d k2 = _mm_set1_pd(K);
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128d s1a = _mm_setzero_pd(), s1b = s1a, s2a = s1a, s2b = s1a;
    __m128 mx4 = _mm_setzero_ps(), un = mx4;
    for (; i + 4 <= c1; i += 4) {
        const __m128 v = _mm_loadu_ps(x + i);
        const __m128d lo = _mm_sub_pd(_mm_cvtps_pd(v), k2);
        const __m128d hi = _mm_sub_pd(_mm_cvtps_pd(_mm_movehl_ps(v, v)), k2);
        s1a = _mm_add_pd(s1a, lo);
        s1b = _mm_add_pd(s1b, hi);
        s2a = _mm_add_pd(s2a, _mm_mul_pd(lo, lo));
        s2b = _mm_add_pd(s2b, _mm_mul_pd(hi, hi));
        const __m128 av = _mm_and_ps(v, abs_mask);
        mx4 = _mm_max_ps(mx4, av);
        un = _mm_or_ps(un, _mm_cmpunord_ps(av, av));
    }
    double r1[2], r2[2];
    float r4[4];
    _mm_storeu_pd(r1, _mm_add_pd(s1a, s1b));
    _mm_storeu_pd(r2, _mm_add_pd(s2a, s2b));
    _mm_storeu_ps(r4, mx4);
    a = r1[0] + r1[1];
    b = r2[0] + r2[1];
    for (int k = 0; k < 4; k++) mx = r4[k] > mx ? r4[k] : mx;
    nan = _mm_movemask_ps(un) != 0;
#endif
    for (; i < c1; i++) {
        const double v = (double)x[i] - K;
        const float av = fabsf(x[i]);
        a += v;
        b += v * v;
        nan |= av != av;
        mx = av > mx ? av : mx;
    }
    part[0] = a;
    part[1] = b;
    part[2] = nan ? NAN : (double)mx;
}

/* The chunks' parts summed in order into out[0..3] (see hvd_moments). */
static inline void moments_total(const double *part, int64_t nchunks, double K, double *out) {
    double a = 0, b = 0, mx = 0;
    int nan = 0;
    for (int64_t c = 0; c < nchunks; c++) {
        a += part[3 * c];
        b += part[3 * c + 1];
        nan |= isnan(part[3 * c + 2]);
        mx = part[3 * c + 2] > mx ? part[3 * c + 2] : mx;
    }
    out[0] = a;
    out[1] = b;
    out[2] = nan ? NAN : mx;
    out[3] = K;
}

static inline double moments_shift(const float *x) { return isfinite(x[0]) ? (double)x[0] : 0.0; }

/* out[0] = Σ(x - K), out[1] = Σ(x - K)², out[2] = max|x| (NaN if any NaN), with K = x[0] when
 * finite (shifted sums: exact zero variance for equal values), all in float64, summed in a fixed
 * order (independent of the thread count). out[3] = K. Returns -1 if out of memory. */
HVD_EXPORT int hvd_moments(const float *x, int64_t n, int32_t nthreads, double *out) {
    out[0] = out[1] = out[2] = out[3] = 0.0;
    if (n <= 0) return 0;
    const double K = moments_shift(x);
    const int64_t nchunks = (n + HVD_MOMENT_CHUNK - 1) / HVD_MOMENT_CHUNK;
    double *part = (double *)malloc((size_t)nchunks * 3 * sizeof(double));
    if (!part) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < nchunks; c++) moments_chunk(x, n, K, c, part + 3 * c);
    moments_total(part, nchunks, K, out);
    free(part);
    return 0;
}

/* hvd_moments of each of nseg tensors back to back in x (segment j: sizes[j] elements) into
 * out[4j .. 4j+3], in one call. Returns -1 if out of memory. */
HVD_EXPORT int hvd_moments_segments(const float *x, int64_t nseg, const int64_t *sizes,
                                    int32_t nthreads, double *out) {
    if (nseg <= 0) return 0;
    int64_t *start = hvd_units(nseg, sizes, HVD_MOMENT_CHUNK);
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * sizeof(int64_t));
    double *part = start ? (double *)malloc((size_t)(start[nseg] + 1) * 3 * sizeof(double)) : NULL;
    if (!start || !off || !part) { free(start); free(off); free(part); return -1; }
    HVD_PREFIX(off, nseg, sizes, n);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < start[nseg]; t++) {
        const int64_t j = hvd_unit_segment(start, nseg, t);
        moments_chunk(x + off[j], sizes[j], moments_shift(x + off[j]), t - start[j], part + 3 * t);
    }
    for (int64_t j = 0; j < nseg; j++) {
        double *o = out + 4 * j;
        o[0] = o[1] = o[2] = o[3] = 0.0;
        if (sizes[j] > 0)
            moments_total(part + 3 * start[j], start[j + 1] - start[j], moments_shift(x + off[j]), o);
    }
    free(start);
    free(off);
    free(part);
    return 0;
}

/* Chunk ch (HVD_CHUNK elements) of hvd_terngrad_encode. */
static inline void terngrad_encode_chunk(const float *x, int64_t n, float c, float s, uint64_t key,
                                         uint8_t *packed, int64_t ch) {
    uint8_t codes[HVD_CHUNK];
    float u[HVD_CHUNK];
    const float safe = s > 0.0f ? s : 1.0f;
    const int on = s > 0.0f;
    const int64_t c0 = ch * HVD_CHUNK, c1 = hvd_min64(n, c0 + HVD_CHUNK), m = c1 - c0;
    hvd_uniforms(key, c0, m, u);
    const float *xx = x + c0;
    for (int64_t t = 0; t < m; t++) {
        float g = xx[t];
        g = g > c ? c : g;
        g = g < -c ? -c : g;
        const int keep = on & (u[t] < fabsf(g) / safe);
        codes[t] = (uint8_t)(1 + keep * ((g > 0.0f) - (g < 0.0f)));
    }
    hvd_pack(codes, m, 2, packed + c0 / 4);
}

/* code = 1 + sign(g)·[u < |g|/s] with g = clamp(x, -c, c) (c = +inf: no clipping), 0 where s is
 * not > 0; packed at 2 bits. */
HVD_EXPORT void hvd_terngrad_encode(const float *x, int64_t n, float c, float s, uint64_t key,
                                    uint8_t *packed, int32_t nthreads) {
    if (n <= 0) return;
    const int64_t nchunks = (n + HVD_CHUNK - 1) / HVD_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) terngrad_encode_chunk(x, n, c, s, key, packed, ch);
}

/* hvd_terngrad_encode of each segment (clip[j], scale[j], keys[j]) in one call; segment j's codes
 * follow those of the segments before it (ceil(n/4) bytes each). Returns -1 if out of memory. */
HVD_EXPORT int hvd_terngrad_encode_segments(const float *x, int64_t nseg, const int64_t *sizes,
                                            const float *clip, const float *scale,
                                            const uint64_t *keys, uint8_t *packed, int32_t nthreads) {
    if (nseg <= 0) return 0;
    int64_t *start = hvd_units(nseg, sizes, HVD_CHUNK);
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * 2 * sizeof(int64_t));
    if (!start || !off) { free(start); free(off); return -1; }
    int64_t *boff = off + (nseg + 1);
    HVD_PREFIX(off, nseg, sizes, n);
    HVD_PREFIX(boff, nseg, sizes, (n + 3) / 4);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < start[nseg]; t++) {
        const int64_t j = hvd_unit_segment(start, nseg, t);
        terngrad_encode_chunk(x + off[j], sizes[j], clip[j], scale[j], keys[j], packed + boff[j],
                              t - start[j]);
    }
    free(start);
    free(off);
    return 0;
}

/* Chunk ch of hvd_terngrad_aggregate for a tensor of n elements whose codes start at
 * packed[w] + bo, with factors f[w·stride]. */
static inline void terngrad_aggregate_chunk(int32_t W, const float *f, int64_t stride,
                                            const uint8_t *const *packed, int64_t bo, int64_t n,
                                            float *out, int64_t ch) {
    uint8_t codes[HVD_CHUNK];
    const int64_t c0 = ch * HVD_CHUNK, c1 = hvd_min64(n, c0 + HVD_CHUNK), m = c1 - c0;
    float *o = out + c0;
    for (int32_t w = 0; w < W; w++) {
        hvd_unpack(packed[w] + bo + c0 / 4, m, 2, codes);
        const float fw = f[w * stride];
        if (w == 0)
            for (int64_t t = 0; t < m; t++) o[t] = 0.0f + fw * (float)((int32_t)codes[t] - 1);
        else
            for (int64_t t = 0; t < m; t++) o[t] += fw * (float)((int32_t)codes[t] - 1);
    }
}

/* out = Σ_w f_w · (code_w - 1) for 2-bit codes (f_w = scale_w / W, given). */
HVD_EXPORT void hvd_terngrad_aggregate(int32_t W, const float *f, const uint8_t *const *packed,
                                       int64_t n, float *out, int32_t nthreads) {
    if (n <= 0) return;
    const int64_t nchunks = (n + HVD_CHUNK - 1) / HVD_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) terngrad_aggregate_chunk(W, f, 1, packed, 0, n, out, ch);
}

/* hvd_terngrad_aggregate of each segment of payloads laid out as hvd_terngrad_encode_segments
 * writes them, with factors f[w·nseg + j], into out (the segments back to back). Returns -1 if out
 * of memory. */
HVD_EXPORT int hvd_terngrad_aggregate_segments(int32_t W, const float *f, const uint8_t *const *packed,
                                               int64_t nseg, const int64_t *sizes, float *out,
                                               int32_t nthreads) {
    if (nseg <= 0) return 0;
    int64_t *start = hvd_units(nseg, sizes, HVD_CHUNK);
    int64_t *off = (int64_t *)malloc((size_t)(nseg + 1) * 2 * sizeof(int64_t));
    if (!start || !off) { free(start); free(off); return -1; }
    int64_t *boff = off + (nseg + 1);
    HVD_PREFIX(off, nseg, sizes, n);
    HVD_PREFIX(boff, nseg, sizes, (n + 3) / 4);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < start[nseg]; t++) {
        const int64_t j = hvd_unit_segment(start, nseg, t);
        terngrad_aggregate_chunk(W, f + j, nseg, packed, boff[j], sizes[j], out + off[j], t - start[j]);
    }
    free(start);
    free(off);
    return 0;
}
