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

/* ---- counter-based random numbers -------------------------------------------------------------
 * Output j of SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
 * OOPSLA 2014) started at `key`: mix(key + (j+1)·φ). Any output can be computed directly from
 * (key, j), so threads need no shared state and the result does not depend on the thread count.
 * One 64-bit output gives the 24-bit uniforms of two consecutive elements: element i uses output
 * i >> 1, bits 40..63 for even i and bits 16..39 for odd i. */
static inline uint64_t hvd_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t hvd_splitmix(uint64_t key, uint64_t j) {
    return hvd_mix64(key + (j + 1) * 0x9E3779B97F4A7C15ULL);
}

/* u[t] = uniform in [0, 1) on the grid k·2^-24 for elements i0 .. i0+m-1. */
static inline void hvd_uniforms(uint64_t key, int64_t i0, int64_t m, float *u) {
    int64_t t = 0;
    if (m <= 0) return;
    if (i0 & 1) {
        uint64_t h = hvd_splitmix(key, (uint64_t)(i0 >> 1));
        u[t++] = (float)((h >> 16) & 0xFFFFFF) * 0x1p-24f;
    }
    for (; t + 1 < m; t += 2) {
        uint64_t h = hvd_splitmix(key, (uint64_t)((i0 + t) >> 1));
        u[t] = (float)(h >> 40) * 0x1p-24f;
        u[t + 1] = (float)((h >> 16) & 0xFFFFFF) * 0x1p-24f;
    }
    if (t < m) {
        uint64_t h = hvd_splitmix(key, (uint64_t)((i0 + t) >> 1));
        u[t] = (float)(h >> 40) * 0x1p-24f;
    }
}

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

/* Unpack m codes from ceil(m·bits/8) bytes at in (reads no byte beyond those). */
static inline void hvd_unpack(const uint8_t *in, int64_t m, int bits, uint8_t *codes) {
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
    float mx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int nan = 0;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
        for (int k = 0; k < 8; k++) {
            float v = fabsf(a[i + k]);
            nan |= v != v;
            mx[k] = v > mx[k] ? v : mx[k];
        }
    for (; i < m; i++) {
        float v = fabsf(a[i]);
        nan |= v != v;
        mx[0] = v > mx[0] ? v : mx[0];
    }
    if (nan) return NAN;
    float r = mx[0];
    for (int k = 1; k < 8; k++) r = mx[k] > r ? mx[k] : r;
    return r;
}

#endif
