/* omniflow's CPU kernels for a bf16 decoder step: what PyTorch runs as chains of small ops
 * (or, for decode attention, as a kernel built for long query blocks) done in one pass.
 *
 * Built by omniflow/kernels/cpu.py with the machine's C compiler (-O3 -march=native -fopenmp),
 * every .c file of this folder into one shared library, and called through ctypes. Loaded
 * after torch, the library shares torch's OpenMP runtime.
 * Every kernel works in float32 and rounds to bf16 (nearest even) where PyTorch's op chain
 * rounds, except that a fused chain keeps float32 between its steps where noted.
 * Decode attention needs AVX-512 BF16; omniflow_decode_attention_supported() says whether
 * this build has it. The projections run on AMX (omniflow_linear_bf16, linear_amx.c) where
 * omniflow_amx_supported() says this build and this kernel have it, else on AVX-512 BF16
 * (omniflow_linear_avx512_bf16, linear_avx512.c; omniflow_avx512_linear_supported()), over
 * the same packed weights.
 *
 * The kernels by family: rows.c (norm with the residual add, rotary, K/V writes, silu * up),
 * decode_attention.c, latent_attention.c (MLA's decode attention over latent pages),
 * linear_amx.c and linear_avx512.c (projections), chunk_attention.c (prefill attention on AMX) and
 * decode_layers.c (a decode step's layers in one call). This header holds what
 * they share: bf16 conversions and vector helpers, and the pieces decode_layers.c runs
 * inside its own parallel region.
 */
#ifndef OMNIFLOW_CPU_KERNELS_H
#define OMNIFLOW_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#else
#define AMX 0
#endif

typedef uint16_t bf16;

/* A large finite stand-in for -inf (the library is built with -ffinite-math-only). */
#define MASKED (-1e30f)

static inline float bf2f(bf16 h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#if defined(__AVX512BF16__)
/* Sixteen lanes at a time, for rows a multiple of 16 long: bf16 loads widen exactly, and
 * stores round to nearest even in one instruction (vcvtneps2bf16), as f2bf does. */
#define VECTOR_ROWS 1
__m512 _ZGVeN16v_expf(__m512); /* glibc's vector expf (libmvec) */

static inline __attribute__((always_inline)) __m512 load16(const bf16 *p)
{
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const void *)p));
}

static inline __attribute__((always_inline)) void store16(bf16 *p, __m512 v)
{
    _mm256_storeu_si256((void *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to bf16 and widened back: where PyTorch's op chain stores a bf16 tensor. */
static inline __attribute__((always_inline)) __m512 rounded(__m512 v)
{
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
}

/* silu(gate) * up of bf16 values (widened), before the product's rounding: the silu rounded
 * as PyTorch's op stores it. */
static inline __attribute__((always_inline)) __m512 silu_mul16(__m512 gate, __m512 up)
{
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f),
                                   _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
    __m512 inv = _mm512_rcp14_ps(d); /* one Newton step: float32-accurate 1 / d */
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(rounded(_mm512_mul_ps(gate, inv)), up);
}

/* The projections' stores (linear_amx.c, linear_avx512.c). */
/* The 16 values of one row of C, rounded, to out[0..min(count, 16)). */
static inline __attribute__((always_inline)) void store_upto16(bf16 *out, __m512 v, int64_t count)
{
    if (count >= 16)
        store16(out, v);
    else if (count > 0)
        _mm256_mask_storeu_epi16(out, (__mmask16)((1u << count) - 1), (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __attribute__((always_inline)) __m512 bias_upto16(const bf16 *bias, int64_t count)
{
    if (count <= 0) return _mm512_setzero_ps();
    const __mmask16 mask = count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1);
    return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias));
}

/* One block of C of up to 32 rows (float32, [32 rows][32 columns], half h's columns at 16 h) out:
 * bias added, rounded; for a gate/up weight (inter > 0) silu(gate) * up, or both halves. */
static inline __attribute__((always_inline)) void store_block(
    const float *c, int64_t m, int64_t m0, int64_t b, int64_t N, int64_t inter, int silu,
    const bf16 *bias, bf16 *out, int64_t ldo)
{
    if (inter > 0) {
        const int64_t col = b * 16, count = inter - col;
        const __m512 bg = bias ? bias_upto16(bias + col, count) : _mm512_setzero_ps();
        const __m512 bu = bias ? bias_upto16(bias + inter + col, count) : _mm512_setzero_ps();
        for (int64_t r = 0; r < m; r++) {
            bf16 *o = out + (m0 + r) * ldo;
            const __m512 gate = rounded(_mm512_add_ps(_mm512_load_ps(c + r * 32), bg));
            const __m512 up = rounded(_mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), bu));
            if (silu) {
                store_upto16(o + col, silu_mul16(gate, up), count);
            } else {
                store_upto16(o + col, gate, count);
                store_upto16(o + inter + col, up, count);
            }
        }
        return;
    }
    const int64_t col = b * 32;
    const __m512 b0 = bias ? bias_upto16(bias + col, N - col) : _mm512_setzero_ps();
    const __m512 b1 = bias ? bias_upto16(bias + col + 16, N - col - 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < m; r++) {
        bf16 *o = out + (m0 + r) * ldo + col;
        store_upto16(o, _mm512_add_ps(_mm512_load_ps(c + r * 32), b0), N - col);
        store_upto16(o + 16, _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1), N - col - 16);
    }
}
#else
#define VECTOR_ROWS 0
#endif

/* Rows above this many elements in all run on `threads` threads; below, one thread (forking
 * costs more than it saves on a decode step's 32 rows).
 *
 * Work is handed out dynamically (schedule(dynamic)), not split evenly up front: on a shared
 * machine one core is now and then much slower than the other (a busy sibling thread), and
 * an even split then waits on it. */
#define PARALLEL_ELEMENTS (1 << 16)

/* What one kernel file runs of another's: the row and task bodies that decode_layers.c calls
 * inside its own parallel region. Hidden: not part of the library's interface. */
#define INTERNAL __attribute__((visibility("hidden")))

INTERNAL void norm_row(bf16 *x, const bf16 *delta, const bf16 *weight, bf16 *out, int64_t r,
                       int64_t hidden, float eps);
INTERNAL void rotary_row(bf16 *x, int64_t row_stride, int64_t r, int64_t heads, int64_t dim,
                         const bf16 *cos, const bf16 *sin);
INTERNAL void kv_write_row(const bf16 *k, const bf16 *v, int64_t row_stride, int64_t r,
                           int64_t kv_heads, int64_t dim, bf16 *cache_k, bf16 *cache_v,
                           int64_t head_stride, const int64_t *slots);

int omniflow_decode_attention_supported(int64_t group, int64_t dim);
#if defined(__AVX512BF16__)
INTERNAL float *attention_scores(int64_t group, int64_t widest);
INTERNAL void attention_body(const bf16 *q, int64_t q_row, const bf16 *keys, const bf16 *values,
                             int64_t head_stride, int64_t page_stride, int64_t page_size,
                             const int64_t *tables, int64_t table_width, const int64_t *lengths,
                             int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                             float scale, bf16 *out, float *scores);
#endif

#if defined(__AVX512BF16__)
INTERNAL void avx512_linear_body(const bf16 *x, int64_t lda, int64_t rows, int64_t K,
                                 const bf16 *packed, int64_t N, int64_t inter, int silu,
                                 const bf16 *bias, bf16 *out, int64_t ldo);
#endif

#if AMX
/* A thread's AMX state for the projections of one parallel region: tiles configured once,
 * two C blocks, and room for TASK_ROWS rows of x as tiles of up to `tile_k` inputs (0: none,
 * every projection reads its rows in place). */
typedef struct {
    float c[2 * 32 * 32] __attribute__((aligned(64)));
    bf16 *tiles;
} amx_scratch;

INTERNAL void amx_begin(amx_scratch *scratch, int64_t tile_k);
INTERNAL void amx_end(amx_scratch *scratch);
INTERNAL int reads_in_place(int64_t rows, int64_t K);
INTERNAL void linear_body(const bf16 *x, int64_t lda, int64_t rows, int64_t K, const bf16 *packed,
                          int64_t N, int64_t inter, int silu, const bf16 *bias, bf16 *out,
                          int64_t ldo, amx_scratch *scratch);
#endif

#endif /* OMNIFLOW_CPU_KERNELS_H */
