/* Shared helpers of hvdcomp's native CPU kernels: counter-based random numbers, bit packing.
 *
 * Everything here is header-only (static inline) so that each kernel file specialises the loops
 * for its constants. Tensors are raw, contiguous, little-endian buffers owned by torch; the
 * Python side (hvdcomp/native/__init__.py) checks dtypes, sizes and contiguity before calling.
 */
#ifndef HVDCOMP_NATIVE_COMMON_H
#define HVDCOMP_NATIVE_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "hvdcomp native kernels assume a little-endian machine (the wire format is little-endian)"
#endif

#define HVD_EXPORT __attribute__((visibility("default")))

/* Elements per work unit of the element-wise kernels (a multiple of 8: packed groups never straddle
 * two units, so units can be processed by different threads). 8192 float32 = 32 KiB. */
#define HVD_CHUNK 8192

static inline int64_t hvd_min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- random numbers for stochastic rounding -----------------------------------------------------
 * Counter-based at the granularity of a work unit: the uniforms of elements [i0, i0 + m) come from
 * four xoshiro128++ streams (Blackman and Vigna, "Scrambled linear pseudorandom number generators",
 * ACM TOMS 2021; the upper 24 of its 32 output bits are used) whose states are seeded with SplitMix64 (Steele, Lea and Flood, OOPSLA 2014) from (key, i0). Work units
 * depend on the tensor's shape and the method's settings only, never on the thread count, so the
 * result is reproducible. Element i0 + t takes stream t % 4, step t / 4; 24-bit uniforms on the grid
 * k·2^-24 (the resolution of torch.rand in float32). The four streams advance in lock step, which
 * compilers vectorise. */
static inline uint64_t hvd_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t hvd_splitmix(uint64_t key, uint64_t j) {
    return hvd_mix64(key + (j + 1) * 0x9E3779B97F4A7C15ULL);
}

#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* u[t] = uniform in [0, 1) for elements i0 .. i0+m-1 of a work unit starting at i0. */
static inline void hvd_uniforms(uint64_t key, int64_t i0, int64_t m, float *u) {
    uint32_t st[4][4];  /* st[word][lane] */
    for (int l = 0; l < 4; l++) {
        const uint64_t a = hvd_splitmix(key, ((uint64_t)i0 << 3) | (uint64_t)(2 * l));
        const uint64_t b = hvd_splitmix(key, ((uint64_t)i0 << 3) | (uint64_t)(2 * l + 1));
        st[0][l] = (uint32_t)a;
        st[1][l] = (uint32_t)(a >> 32);
        st[2][l] = (uint32_t)b;
        st[3][l] = (uint32_t)(b >> 32) | 1u;  /* never the all-zero state */
    }
    int64_t t = 0;
#ifdef __SSE2__
    __m128i s0 = _mm_loadu_si128((const __m128i *)st[0]), s1 = _mm_loadu_si128((const __m128i *)st[1]);
    __m128i s2 = _mm_loadu_si128((const __m128i *)st[2]), s3 = _mm_loadu_si128((const __m128i *)st[3]);
    const __m128 scale = _mm_set1_ps(0x1p-24f);
    for (; t + 4 <= m; t += 4) {
        const __m128i sum = _mm_add_epi32(s0, s3);
        const __m128i out = _mm_add_epi32(_mm_or_si128(_mm_slli_epi32(sum, 7), _mm_srli_epi32(sum, 25)), s0);
        _mm_storeu_ps(u + t, _mm_mul_ps(_mm_cvtepi32_ps(_mm_srli_epi32(out, 8)), scale));
        const __m128i sh = _mm_slli_epi32(s1, 9);
        s2 = _mm_xor_si128(s2, s0);
        s3 = _mm_xor_si128(s3, s1);
        s1 = _mm_xor_si128(s1, s2);
        s0 = _mm_xor_si128(s0, s3);
        s2 = _mm_xor_si128(s2, sh);
        s3 = _mm_or_si128(_mm_slli_epi32(s3, 11), _mm_srli_epi32(s3, 21));
    }
    _mm_storeu_si128((__m128i *)st[0], s0);
    _mm_storeu_si128((__m128i *)st[1], s1);
    _mm_storeu_si128((__m128i *)st[2], s2);
    _mm_storeu_si128((__m128i *)st[3], s3);
#endif
    for (; t < m; t += 4) {  /* the same streams without SSE2, and the last < 4 elements */
        for (int l = 0; l < 4 && t + l < m; l++) {
            const uint32_t sum = st[0][l] + st[3][l];
            u[t + l] = (float)((((sum << 7) | (sum >> 25)) + st[0][l]) >> 8) * 0x1p-24f;
        }
        for (int l = 0; l < 4; l++) {
            const uint32_t sh = st[1][l] << 9;
            st[2][l] ^= st[0][l];
            st[3][l] ^= st[1][l];
            st[1][l] ^= st[2][l];
            st[0][l] ^= st[3][l];
            st[2][l] ^= sh;
            st[3][l] = (st[3][l] << 11) | (st[3][l] >> 21);
        }
    }
}

/* ---- segmented calls ----------------------------------------------------------------------------
 * A segmented kernel runs a per-tensor kernel on each of `nseg` tensors laid back to back in one
 * flat buffer (segment j: sizes[j] elements), in one call: each segment splits into the work units
 * the per-tensor kernel uses (ceil(sizes[j]/unit) of them), and the units of every segment are
 * shared among the threads. start[j] is segment j's first unit (prefix sums, nseg + 1 entries, from
 * hvd_units); hvd_unit_segment finds the segment of unit t. */
static inline int64_t *hvd_units(int64_t nseg, const int64_t *sizes, int64_t unit) {
    int64_t *start = (int64_t *)malloc((size_t)(nseg + 1) * sizeof(int64_t));
    if (!start) return NULL;
    start[0] = 0;
    for (int64_t j = 0; j < nseg; j++) start[j + 1] = start[j] + (sizes[j] + unit - 1) / unit;
    return start;
}

static inline int64_t hvd_unit_segment(const int64_t *start, int64_t nseg, int64_t t) {
    int64_t lo = 0, hi = nseg - 1;  /* the last j with start[j] <= t */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Prefix sums of f(sizes[j]) (nseg + 1 entries) into out. */
#define HVD_PREFIX(out, nseg, sizes, EXPR)                          \
    do {                                                            \
        (out)[0] = 0;                                               \
        for (int64_t j_ = 0; j_ < (nseg); j_++) {                   \
            const int64_t n = (sizes)[j_];                          \
            (out)[j_ + 1] = (out)[j_] + (EXPR);                     \
        }                                                           \
    } while (0)

/* ---- bit packing --------------------------------------------------------------------------------
 * Codes of `bits` bits (1..8) in a little-endian bit stream: code i occupies bits [i·b, (i+1)·b),
 * the same layout as hvdcomp/compressors/bitpack.py. Eight codes always fill exactly `bits` bytes,
 * so a group of 8 is assembled in one 64-bit word and stored with one fixed-size copy. */
/* A group's word is stored (loaded) with one 8-byte access while 8 bytes fit before the end of the
 * groups (the next group overwrites the excess), else with exactly B bytes. */
#define HVD_PACK_GROUPS(B)                                                          \
    for (int64_t q = 0; q < groups; q++) {                                          \
        uint64_t w = 0;                                                             \
        for (int k = 0; k < 8; k++) w |= (uint64_t)codes[8 * q + k] << (k * (B));  \
        if (q * (B) + 8 <= groups * (B)) memcpy(out + q * (B), &w, 8);              \
        else memcpy(out + q * (B), &w, (B));                                        \
    }

#define HVD_UNPACK_GROUPS(B)                                                        \
    for (int64_t q = 0; q < groups; q++) {                                          \
        uint64_t w = 0;                                                             \
        if (q * (B) + 8 <= groups * (B)) memcpy(&w, in + q * (B), 8);               \
        else memcpy(&w, in + q * (B), (B));                                         \
        for (int k = 0; k < 8; k++)                                                 \
            codes[8 * q + k] = (uint8_t)((w >> (k * (B))) & ((1u << (B)) - 1u));    \
    }

/* Pack m codes into ceil(m·bits/8) bytes at out. */
static inline void hvd_pack(const uint8_t *codes, int64_t m, int bits, uint8_t *out) {
    int64_t groups = m / 8;
    switch (bits) {
    case 1: HVD_PACK_GROUPS(1) break;
    case 2: HVD_PACK_GROUPS(2) break;
    case 3: HVD_PACK_GROUPS(3) break;
    case 4: HVD_PACK_GROUPS(4) break;
    case 5: HVD_PACK_GROUPS(5) break;
    case 6: HVD_PACK_GROUPS(6) break;
    case 7: HVD_PACK_GROUPS(7) break;
    default: memcpy(out, codes, (size_t)m); return;
    }
    int64_t rest = m - 8 * groups;
    if (rest) {
        uint64_t w = 0;
        for (int k = 0; k < rest; k++) w |= (uint64_t)codes[8 * groups + k] << (k * bits);
        memcpy(out + groups * bits, &w, (size_t)((rest * bits + 7) / 8));
    }
}

#ifdef __SSE2__
/* 16 codes of 1, 2 or 4 bits (2, 4 or 8 input bytes) per step, with byte shifts and masks. */
static inline int64_t hvd_unpack_sse2(const uint8_t *in, int64_t m, int bits, uint8_t *codes) {
    int64_t t = 0;
    if (bits == 4) {
        const __m128i lo4 = _mm_set1_epi8(0x0F);
        for (; t + 16 <= m; t += 16) {
            const __m128i v = _mm_loadl_epi64((const __m128i *)(in + t / 2));
            const __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
            _mm_storeu_si128((__m128i *)(codes + t), _mm_unpacklo_epi8(lo, hi));
        }
    } else if (bits == 2) {
        const __m128i lo2 = _mm_set1_epi8(0x03);
        for (; t + 16 <= m; t += 16) {
            int32_t word;
            memcpy(&word, in + t / 4, 4);
            const __m128i v = _mm_cvtsi32_si128(word);
            const __m128i c0 = _mm_and_si128(v, lo2), c1 = _mm_and_si128(_mm_srli_epi16(v, 2), lo2);
            const __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), lo2), c3 = _mm_and_si128(_mm_srli_epi16(v, 6), lo2);
            _mm_storeu_si128((__m128i *)(codes + t),
                             _mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3)));
        }
    } else if (bits == 1) {
        const __m128i bit = _mm_set_epi8((char)128, 64, 32, 16, 8, 4, 2, 1, (char)128, 64, 32, 16, 8, 4, 2, 1);
        const __m128i one = _mm_set1_epi8(1);
        for (; t + 16 <= m; t += 16) {
            const __m128i v = _mm_unpacklo_epi64(_mm_set1_epi8((char)in[t / 8]), _mm_set1_epi8((char)in[t / 8 + 1]));
            _mm_storeu_si128((__m128i *)(codes + t), _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, bit), bit), one));
        }
    }
    return t;
}
#endif

/* Unpack m codes from ceil(m·bits/8) bytes at in (reads no byte beyond those). */
static inline void hvd_unpack(const uint8_t *in, int64_t m, int bits, uint8_t *codes) {
#ifdef __SSE2__
    if (bits == 1 || bits == 2 || bits == 4) {
        const int64_t done = hvd_unpack_sse2(in, m, bits, codes);  /* a multiple of 16 codes */
        in += done * bits / 8;
        codes += done;
        m -= done;
    }
#endif
    int64_t groups = m / 8;
    switch (bits) {
    case 1: HVD_UNPACK_GROUPS(1) break;
    case 2: HVD_UNPACK_GROUPS(2) break;
    case 3: HVD_UNPACK_GROUPS(3) break;
    case 4: HVD_UNPACK_GROUPS(4) break;
    case 5: HVD_UNPACK_GROUPS(5) break;
    case 6: HVD_UNPACK_GROUPS(6) break;
    case 7: HVD_UNPACK_GROUPS(7) break;
    default: memcpy(codes, in, (size_t)m); return;
    }
    int64_t rest = m - 8 * groups;
    if (rest) {
        uint64_t w = 0;
        memcpy(&w, in + groups * bits, (size_t)((rest * bits + 7) / 8));
        for (int k = 0; k < rest; k++) codes[8 * groups + k] = (uint8_t)((w >> (k * bits)) & ((1u << bits) - 1u));
    }
}

/* Sum of a[0..m) in double with 8 independent accumulators (vectorisable; fixed order). */
static inline double hvd_sum_abs_f64(const float *a, int64_t m) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += fabs((double)a[i + k]);
    for (; i < m; i++) acc[0] += fabs((double)a[i]);
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static inline double hvd_sum_sq_f64(const float *a, int64_t m) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
        for (int k = 0; k < 8; k++) { double v = a[i + k]; acc[k] += v * v; }
    for (; i < m; i++) { double v = a[i]; acc[0] += v * v; }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* max |a[i]|, NaN if any element is NaN (as torch.amax). */
static inline float hvd_max_abs(const float *a, int64_t m) {
    float best = 0.0f;
    int nan = 0;
    int64_t i = 0;
#ifdef __SSE2__
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 mx0 = _mm_setzero_ps(), mx1 = mx0, un = mx0;
    for (; i + 8 <= m; i += 8) {
        const __m128 v0 = _mm_and_ps(_mm_loadu_ps(a + i), abs_mask);
        const __m128 v1 = _mm_and_ps(_mm_loadu_ps(a + i + 4), abs_mask);
        mx0 = _mm_max_ps(mx0, v0);
        mx1 = _mm_max_ps(mx1, v1);
        un = _mm_or_ps(un, _mm_or_ps(_mm_cmpunord_ps(v0, v0), _mm_cmpunord_ps(v1, v1)));
    }
    float r[4];
    _mm_storeu_ps(r, _mm_max_ps(mx0, mx1));
    nan = _mm_movemask_ps(un) != 0;
    for (int k = 0; k < 4; k++) best = r[k] > best ? r[k] : best;
#endif
    for (; i < m; i++) {
        const float v = fabsf(a[i]);
        nan |= v != v;
        best = v > best ? v : best;
    }
    return nan ? NAN : best;
}

#endif
