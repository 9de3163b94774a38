/* Native CPU kernels of the sparsifiers (top-k, DGC, threshold, random-k): a fused
 * threshold-and-compact scan, and the scatter-add of every rank's payload in one write pass. */
#include <stdlib.h>

#include "common.h"

/* The scan works on fixed parts of HVD_SCAN_PART elements (the count of a part and its place in
 * the output do not depend on the thread count). */
#define HVD_SCAN_PART 65536

HVD_EXPORT int64_t hvd_scan_parts(int64_t n) { return (n + HVD_SCAN_PART - 1) / HVD_SCAN_PART; }

#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* Bit t of the result: v_t >= thr for t < len (len <= 64), v = |x| if absval else x; NaN never
 * passes. SSE2 (every x86-64): 16 compares and movemasks per 64 elements. */
static inline uint64_t mask64(const float *x, int64_t len, float thr, int32_t absval) {
    uint64_t bits = 0;
#ifdef __SSE2__
    if (len >= 64) {
        const __m128 t = _mm_set1_ps(thr);
        const __m128 keep = absval ? _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff))
                                   : _mm_castsi128_ps(_mm_set1_epi32(-1));
        for (int q = 0; q < 4; q++) {  /* 16 compares packed to 16 bytes, one movemask */
            const float *p = x + 16 * q;
            const __m128i c0 = _mm_castps_si128(_mm_cmpge_ps(_mm_and_ps(_mm_loadu_ps(p), keep), t));
            const __m128i c1 = _mm_castps_si128(_mm_cmpge_ps(_mm_and_ps(_mm_loadu_ps(p + 4), keep), t));
            const __m128i c2 = _mm_castps_si128(_mm_cmpge_ps(_mm_and_ps(_mm_loadu_ps(p + 8), keep), t));
            const __m128i c3 = _mm_castps_si128(_mm_cmpge_ps(_mm_and_ps(_mm_loadu_ps(p + 12), keep), t));
            const __m128i b = _mm_packs_epi16(_mm_packs_epi32(c0, c1), _mm_packs_epi32(c2, c3));
            bits |= (uint64_t)(uint32_t)_mm_movemask_epi8(b) << (16 * q);
        }
        return bits;
    }
#endif
    for (int t = 0; t < len && t < 64; t++)
        bits |= (uint64_t)((absval ? fabsf(x[t]) : x[t]) >= thr) << t;
    return bits;
}

/* counts[p] = #{i in part p : v_i >= thr}, v = |x| if absval else x (NaN never passes).
 * Returns the total. */
HVD_EXPORT int64_t hvd_count_at_least(const float *x, int64_t n, float thr, int32_t absval,
                                      int64_t *counts, int32_t nthreads) {
    const int64_t parts = hvd_scan_parts(n);
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(nthreads)
    for (int64_t p = 0; p < parts; p++) {
        const int64_t c0 = p * HVD_SCAN_PART, c1 = hvd_min64(n, c0 + HVD_SCAN_PART);
        int32_t c = 0;
        if (absval)
            for (int64_t i = c0; i < c1; i++) c += fabsf(x[i]) >= thr;
        else
            for (int64_t i = c0; i < c1; i++) c += x[i] >= thr;
        counts[p] = c;
        total += c;
    }
    return total;
}

/* Appends the positions base + t of the set bits of `bits` (and the x values there). */
#define HVD_EMIT_BITS(bits, base, x, IDX, VAL, O)                                     \
    for (uint64_t b_ = (bits); b_; b_ &= b_ - 1) {                                     \
        const int64_t i_ = (base) + __builtin_ctzll(b_);                               \
        (IDX)[(O)] = i_;                                                               \
        if (VAL) (VAL)[(O)] = (x)[i_];                                                 \
        (O)++;                                                                         \
    }

/* Writes the ascending indices i with v_i >= thr (see hvd_count_at_least, whose counts it takes)
 * to idx, and x_i to values if values is not NULL. */
HVD_EXPORT void hvd_compact_at_least(const float *x, int64_t n, float thr, int32_t absval,
                                     const int64_t *counts, int64_t *idx, float *values,
                                     int32_t nthreads) {
    const int64_t parts = hvd_scan_parts(n);
    int64_t *offsets = (int64_t *)malloc((size_t)(parts + 1) * sizeof(int64_t));
    int64_t acc = 0;
    if (!offsets) {  /* serial fallback: no scratch needed */
        int64_t o = 0;
        for (int64_t i = 0; i < n; i++)
            if ((absval ? fabsf(x[i]) : x[i]) >= thr) {
                idx[o] = i;
                if (values) values[o] = x[i];
                o++;
            }
        return;
    }
    for (int64_t p = 0; p < parts; p++) { offsets[p] = acc; acc += counts[p]; }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < parts; p++) {
        if (!counts[p]) continue;
        const int64_t c0 = p * HVD_SCAN_PART, c1 = hvd_min64(n, c0 + HVD_SCAN_PART);
        int64_t o = offsets[p];
        for (int64_t base = c0; base < c1; base += 64) {
            const uint64_t bits = mask64(x + base, c1 - base, thr, absval);
            HVD_EMIT_BITS(bits, base, x, idx, values, o);
        }
    }
    free(offsets);
}

/* One-pass fused threshold-and-compact. hvd_select_begin scans x once (each thread a contiguous
 * range, its hits appended to its own growing buffer), stores the total in *total and returns a
 * handle; hvd_select_finish copies the hits, in ascending order, to idx (and values) and frees the
 * handle. Returns NULL (nothing to free) if memory runs out: use count + compact then. */
typedef struct {
    int nt;
    int64_t *count;
    int64_t **idx;
    float **val;
} hvd_selection;

static void selection_free(hvd_selection *s) {
    if (!s) return;
    for (int t = 0; t < s->nt; t++) {
        if (s->idx) free(s->idx[t]);
        if (s->val) free(s->val[t]);
    }
    free(s->count);
    free(s->idx);
    free(s->val);
    free(s);
}

HVD_EXPORT void *hvd_select_begin(const float *x, int64_t n, float thr, int32_t absval,
                                  int32_t want_values, int32_t nthreads, int64_t *total) {
    const int nt = nthreads < 1 ? 1 : nthreads;
    hvd_selection *s = (hvd_selection *)calloc(1, sizeof(hvd_selection));
    if (!s) return NULL;
    s->nt = nt;
    s->count = (int64_t *)calloc((size_t)nt, sizeof(int64_t));
    s->idx = (int64_t **)calloc((size_t)nt, sizeof(int64_t *));
    s->val = (float **)calloc((size_t)nt, sizeof(float *));
    if (!s->count || !s->idx || !s->val) { selection_free(s); return NULL; }
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        /* contiguous ranges in multiples of 64 elements, in thread order */
        const int64_t blocks = (n + 63) / 64;
        const int64_t r0 = hvd_min64(n, blocks * t / T * 64), r1 = hvd_min64(n, blocks * (t + 1) / T * 64);
        int64_t cap = (r1 - r0) / 64 + 1024, o = 0;
        int64_t *ii = (int64_t *)malloc((size_t)cap * sizeof(int64_t));
        float *vv = want_values ? (float *)malloc((size_t)cap * sizeof(float)) : NULL;
        if (!ii || (want_values && !vv)) failed = 1;
        for (int64_t base = r0; base < r1 && !failed; base += 64) {
            if (o + 64 > cap) {
                cap *= 2;
                int64_t *ni = (int64_t *)realloc(ii, (size_t)cap * sizeof(int64_t));
                if (ni) ii = ni;
                float *nv = want_values ? (float *)realloc(vv, (size_t)cap * sizeof(float)) : NULL;
                if (nv) vv = nv;
                if (!ni || (want_values && !nv)) { failed = 1; break; }
            }
            const uint64_t bits = mask64(x + base, r1 - base, thr, absval);
            HVD_EMIT_BITS(bits, base, x, ii, vv, o);
        }
        s->idx[t] = ii;
        s->val[t] = vv;
        s->count[t] = o;  /* threads the runtime did not start leave count 0, idx NULL */
    }
    if (failed) { selection_free(s); return NULL; }
    int64_t sum = 0;
    for (int t = 0; t < nt; t++) sum += s->count[t];
    *total = sum;
    return s;
}

HVD_EXPORT void hvd_select_finish(void *handle, int64_t *idx, float *values) {
    hvd_selection *s = (hvd_selection *)handle;
    int64_t o = 0;
    for (int t = 0; t < s->nt; t++) {
        if (s->count[t]) {
            memcpy(idx + o, s->idx[t], (size_t)s->count[t] * sizeof(int64_t));
            if (values && s->val[t]) memcpy(values + o, s->val[t], (size_t)s->count[t] * sizeof(float));
        }
        o += s->count[t];
    }
    selection_free(s);
}

static int64_t lower_bound(const int64_t *a, int64_t m, int64_t key) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

#define HVD_SCATTER_CHUNK 16384

/* out = scale · Σ_w payload_w, where payload w is sparse (counts[w] >= 0 values at ascending
 * indices idx[w]) or dense (counts[w] < 0: values[w] holds n elements). Every output element is
 * written once (chunk by chunk: zero, then each payload's entries in the chunk, in payload order).
 * Returns -1 without writing anything if an index is out of [0, n) or not ascending. */
HVD_EXPORT int hvd_sparse_aggregate(int32_t W, const int64_t *const *idx,
                                    const float *const *values, const int64_t *counts, float scale,
                                    int64_t n, float *out, int32_t nthreads) {
    for (int32_t w = 0; w < W; w++) {
        const int64_t *ii = idx[w];
        const int64_t m = counts[w];
        if (m <= 0) continue;
        if (ii[0] < 0 || ii[m - 1] >= n) return -1;
        for (int64_t t = 1; t < m; t++)
            if (ii[t] < ii[t - 1]) return -1;
    }
    if (n <= 0) return 0;
    const int64_t nchunks = (n + HVD_SCATTER_CHUNK - 1) / HVD_SCATTER_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t c0 = ch * HVD_SCATTER_CHUNK, c1 = hvd_min64(n, c0 + HVD_SCATTER_CHUNK);
        float *o = out + c0;
        for (int64_t t = 0; t < c1 - c0; t++) o[t] = 0.0f;
        for (int32_t w = 0; w < W; w++) {
            const float *v = values[w];
            const int64_t m = counts[w];
            if (m < 0) {
                for (int64_t t = 0; t < c1 - c0; t++) o[t] += scale * v[c0 + t];
                continue;
            }
            const int64_t *ii = idx[w];
            for (int64_t t = lower_bound(ii, m, c0); t < m && ii[t] < c1; t++) out[ii[t]] += scale * v[t];
        }
    }
    return 0;
}

/* Random-k's shared indices: marks the values of `stream` (draws in [0, n), in draw order) in
 * `bitmap` (ceil(n/64) words) until k distinct values are marked; returns how many are marked
 * (starting from `count`, the return value of the previous call for the same bitmap), or -1 for a
 * value outside [0, n). The marked set is the first k distinct values of the draws. */
HVD_EXPORT int64_t hvd_mark_distinct(const int64_t *stream, int64_t m, int64_t n, uint64_t *bitmap,
                                     int64_t count, int64_t k) {
    for (int64_t i = 0; i < m && count < k; i++) {
        const int64_t v = stream[i];
        if (v < 0 || v >= n) return -1;
        const uint64_t bit = 1ULL << (v & 63);
        if (!(bitmap[v >> 6] & bit)) {
            bitmap[v >> 6] |= bit;
            count++;
        }
    }
    return count;
}

/* The set bits of `bitmap` (n bits) as ascending indices; returns how many were written. */
HVD_EXPORT int64_t hvd_bitmap_indices(const uint64_t *bitmap, int64_t n, int64_t *idx) {
    int64_t o = 0;
    const int64_t words = (n + 63) / 64;
    for (int64_t w = 0; w < words; w++)
        for (uint64_t x = bitmap[w]; x; x &= x - 1) idx[o++] = w * 64 + __builtin_ctzll(x);
    return o;
}

/* The k entries of largest magnitude among m candidates (ascending indices idx, values v, |v| if
 * absval), given t = the k-th largest magnitude: every candidate above t, then the first ones equal
 * to t until k are taken; written to out in ascending order. Returns how many were written (k
 * unless fewer than k candidates are >= t). */
HVD_EXPORT int64_t hvd_keep_top(const float *v, const int64_t *idx, int64_t m, float t, int64_t k,
                                int32_t absval, int64_t *out) {
    int64_t above = 0;
    for (int64_t i = 0; i < m; i++) above += (absval ? fabsf(v[i]) : v[i]) > t;
    int64_t ties = k - above, o = 0;
    for (int64_t i = 0; i < m && o < k; i++) {
        const float a = absval ? fabsf(v[i]) : v[i];
        if (a > t || (a == t && ties-- > 0)) out[o++] = idx[i];
    }
    return o;
}

/* hvd_mark_distinct for each of nseg tensors (segment j: sizes[j] elements, ks[j] wanted,
 * counts[j] marked so far, its draws streams[j] of lens[j] values, its bitmap at word
 * Σ_{i<j} ceil(sizes[i]/64) of `bitmaps`); counts is updated. Returns -1 for a value outside
 * its segment's [0, n), else 0. */
HVD_EXPORT int hvd_mark_distinct_segments(int64_t nseg, const int64_t *const *streams, const int64_t *lens,
                                          const int64_t *sizes, const int64_t *ks, uint64_t *bitmaps,
                                          int64_t *counts) {
    int64_t word = 0;
    for (int64_t j = 0; j < nseg; j++) {
        if (lens[j] > 0 && counts[j] < ks[j]) {
            const int64_t c = hvd_mark_distinct(streams[j], lens[j], sizes[j], bitmaps + word, counts[j], ks[j]);
            if (c < 0) return -1;
            counts[j] = c;
        }
        word += (sizes[j] + 63) / 64;
    }
    return 0;
}

/* hvd_bitmap_indices of each segment's bitmap (laid out as in hvd_mark_distinct_segments), each
 * index plus its segment's first element (Σ_{i<j} sizes[i]), written back to back to idx (so
 * ascending over the whole buffer). Returns how many were written. */
HVD_EXPORT int64_t hvd_bitmap_indices_segments(int64_t nseg, const int64_t *sizes, const uint64_t *bitmaps,
                                               int64_t *idx) {
    int64_t word = 0, first = 0, o = 0;
    for (int64_t j = 0; j < nseg; j++) {
        const int64_t got = hvd_bitmap_indices(bitmaps + word, sizes[j], idx + o);
        for (int64_t t = o; t < o + got; t++) idx[t] += first;
        o += got;
        word += (sizes[j] + 63) / 64;
        first += sizes[j];
    }
    return o;
}
