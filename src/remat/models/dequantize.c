/* GGUF blocks to float32 or bfloat16 in one pass: remat's compiled kernels (remat/models/native.py builds this file).
 *
 * Each kernel is the torch kernel of remat/models/quant.py written out per element: the same float32 operations in
 * the same order, so the values equal gguf-py's `gguf.quants.dequantize` bit for bit (tests/test_quant.py). Built
 * with -ffp-contract=off: a multiply-add fused into one rounding would differ. Blocks whose half scales are not
 * finite are not made here (the call answers 1 and quant.py's torch kernels, which keep numpy's NaN payloads, make
 * the tensor): with finite scales no value is NaN, so no payload rule applies.
 *
 * Why not torch ops: they make three to five weight-sized temporaries per weight, each written and read again;
 * this writes the weight once (SmolLM2's [1536, 576] Q4_1 weight into bfloat16, torch's two threads: ~75 us). */
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static int finite_half(const uint8_t *p) { return (((p[0] | p[1] << 8) & 0x7C00) != 0x7C00); }

static float half(const uint8_t *p) {  /* a finite half, exactly */
    uint32_t h = p[0] | p[1] << 8, sign = (h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, u;
    float f;
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact */
        f = (float)m * 5.9604644775390625e-08f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (e + 112) << 23 | m << 13;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* One block's values into y (32 or 256 floats); 0, or 1 where a scale is not finite. */
static int block(int qtype, const uint8_t *b, float *restrict y) {
    switch (qtype) {
    case Q4_0: {
        if (!finite_half(b)) return 1;
        const float d = half(b);
        for (int j = 0; j < 16; j++) {
            y[j] = ((float)(b[2 + j] & 0x0F) - 8.0f) * d;
            y[j + 16] = ((float)(b[2 + j] >> 4) - 8.0f) * d;
        }
        return 0;
    }
    case Q4_1: {
        if (!finite_half(b) || !finite_half(b + 2)) return 1;
        const float d = half(b), m = half(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[4 + j] & 0x0F) * d + m;
            y[j + 16] = (float)(b[4 + j] >> 4) * d + m;
        }
        return 0;
    }
    case Q5_0: case Q5_1: {
        const int one = qtype == Q5_1, qs = one ? 8 : 6;
        if (!finite_half(b) || (one && !finite_half(b + 2))) return 1;
        const float d = half(b), m = one ? half(b + 2) : 0.0f;
        const uint32_t qh = b[qs - 4] | b[qs - 3] << 8 | b[qs - 2] << 16 | (uint32_t)b[qs - 1] << 24;
        for (int j = 0; j < 16; j++) {
            const float lo = (float)((b[qs + j] & 0x0F) | ((qh >> j) & 1) << 4);
            const float hi = (float)((b[qs + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
            y[j] = one ? lo * d + m : (lo - 16.0f) * d;
            y[j + 16] = one ? hi * d + m : (hi - 16.0f) * d;
        }
        return 0;
    }
    case Q8_0: {
        if (!finite_half(b)) return 1;
        const float d = half(b);
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        return 0;
    }
    case Q4_K: case Q5_K: {
        if (!finite_half(b) || !finite_half(b + 2)) return 1;
        const float d = half(b), dmin = half(b + 2);
        const uint8_t *s = b + 4, *qh = b + 16, *qs = qtype == Q5_K ? b + 48 : b + 16;
        for (int i = 0; i < 8; i++) {  /* sub-block i: nibbles of bytes 32 (i / 2) .. +31, low then high */
            const int sc = i < 4 ? s[i] & 0x3F : (s[i + 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
            const int mn = i < 4 ? s[i + 4] & 0x3F : (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *q = qs + 32 * (i / 2);
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> (4 * (i & 1))) & 0x0F;
                if (qtype == Q5_K) v |= ((qh[l] >> i) & 1) << 4;
                y[32 * i + l] = (float)v * ds - dm;
            }
        }
        return 0;
    }
    case Q6_K: {
        if (!finite_half(b + 208)) return 1;
        const float d = half(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        for (int g = 0; g < 16; g++) {  /* 16 groups of 16, each with its int8 scale */
            const float dg = d * (float)(int8_t)b[192 + g];
            for (int k = 0; k < 16; k++) {
                const int e = 16 * g + k, h = e / 128, r = e % 128;
                const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
                const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                y[e] = dg * (float)((int8_t)(uint8_t)(lo | hi << 4) - 32);
            }
        }
        return 0;
    }
    }
    return -1;
}

static uint16_t bfloat16(float f) {  /* round to nearest even, as torch casts a finite float */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
/* Q4_1 and Q8_0 (the default model's types) sixteen values at a time: the same float32 products and sums (one
 * rounding each: intrinsics are not contracted), the same rounding to bfloat16, in integers. 1.6x the loop above
 * into bfloat16 (SmolLM2's [1536, 576] Q4_1 weight: 215 -> 131 us, where writing the output bounds it). */
#define VECTOR_TYPE(q) ((q) == Q4_1 || (q) == Q8_0)

static inline float half_f16c(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }

static inline __m512i bf16_bits(__m512 y) {  /* `bfloat16` above, in each lane's low half */
    const __m512i u = _mm512_castps_si512(y);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

static inline void put32(__m512 a, __m512 b, void *out, int bf16) {  /* a block's 32 values: a's 16, then b's */
    if (!bf16) {
        _mm512_storeu_ps(out, a);
        _mm512_storeu_ps((float *)out + 16, b);
        return;
    }
    const __m512i low_halves = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                                30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    _mm512_storeu_si512(out, _mm512_permutex2var_epi16(bf16_bits(a), low_halves, bf16_bits(b)));
}

static int vector_rows(int qtype, const uint8_t *blocks, int64_t first, int64_t count, void *out, int bf16) {
    const int64_t esize = bf16 ? 2 : 4;
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t i = first; i < first + count; i++) {
        char *o = (char *)out + i * 32 * esize;
        if (qtype == Q4_1) {
            const uint8_t *b = blocks + i * 20;
            if (!finite_half(b) || !finite_half(b + 2)) return 1;
            const __m512 d = _mm512_set1_ps(half_f16c(b)), m = _mm512_set1_ps(half_f16c(b + 2));
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, nibble)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), nibble)));
            put32(_mm512_add_ps(_mm512_mul_ps(lo, d), m), _mm512_add_ps(_mm512_mul_ps(hi, d), m), o, bf16);
        } else {  /* Q8_0 */
            const uint8_t *b = blocks + i * 34;
            if (!finite_half(b)) return 1;
            const __m512 d = _mm512_set1_ps(half_f16c(b));
            const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
            const __m512 y = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
            put32(_mm512_mul_ps(x, d), _mm512_mul_ps(y, d), o, bf16);
        }
    }
    return 0;
}
#else
#define VECTOR_TYPE(q) 0
static int vector_rows(int qtype, const uint8_t *blocks, int64_t first, int64_t count, void *out, int bf16) {
    (void)qtype, (void)blocks, (void)first, (void)count, (void)out, (void)bf16;
    return -1;
}
#endif

/* Blocks first .. first + count - 1; 0, or 1 where a scale is not finite. */
static int rows(int qtype, const uint8_t *blocks, int64_t first, int64_t count, int64_t size, int64_t values,
                void *out, int bf16) {
    if (VECTOR_TYPE(qtype)) return vector_rows(qtype, blocks, first, count, out, bf16);
    float y[256];
    for (int64_t i = first; i < first + count; i++) {
        float *dst = bf16 ? y : (float *)out + i * values;
        int status = block(qtype, blocks + i * size, dst);
        if (status) return status;
        if (bf16)
            for (int64_t j = 0; j < values; j++) ((uint16_t *)out)[i * values + j] = bfloat16(y[j]);
    }
    return 0;
}

/* `count` blocks of `size` bytes and `values` values each into `out` (float32, or bfloat16 where bf16 is set), on
 * `threads` threads of OpenMP's team: torch's own (the library links the libgomp torch loaded), so its workers,
 * still spinning after torch's last op, take their share at once. 0: done; 1: a scale is not finite (out is partly
 * written); -1: not a type of this file. */
int remat_dequantize(int qtype, const uint8_t *blocks, int64_t count, int64_t size, int64_t values, void *out,
                     int bf16, int threads) {
    enum { MAX = 64 };
    int status[MAX] = {0};
    threads = threads < 1 ? 1 : threads > MAX ? MAX : threads;
    if (threads > count) threads = count > 1 ? (int)count : 1;
    const int64_t per = (count + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        const int64_t first = t * per, n = count - first < per ? count - first : per;
        if (n > 0) status[t] = rows(qtype, blocks, first, n, size, values, out, bf16);
    }
    for (int t = 0; t < threads; t++)
        if (status[t]) return status[t];
    return 0;
}
