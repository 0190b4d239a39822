/* Kernels that run row by row: the norm with its residual add, rotary, the K/V writes into
 * the pages, silu * up. */
#include "cpu_kernels.h"

/* x[r] += delta[r] (rounded, when delta is not NULL); out[r] = weight * rmsnorm(x[r]).
 * As transformers' RMSNorm: variance in float32, normalised value rounded to bf16, then
 * multiplied by the bf16 weight and rounded again. x, delta, out: [rows, hidden] contiguous. */
void norm_row(bf16 *x, const bf16 *delta, const bf16 *weight, bf16 *out, int64_t r,
              int64_t hidden, float eps)
{
    bf16 *xr = x + r * hidden;
#if VECTOR_ROWS
    if (hidden % 16 == 0) {
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            __m512 v = load16(xr + i);
            if (delta) {
                v = rounded(_mm512_add_ps(v, load16(delta + r * hidden + i)));
                store16(xr + i, v);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv = _mm512_set1_ps(
            1.f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
        for (int64_t i = 0; i < hidden; i += 16)
            store16(out + r * hidden + i,
                    _mm512_mul_ps(load16(weight + i), rounded(_mm512_mul_ps(load16(xr + i), inv))));
        return;
    }
#endif
    float sum = 0.f;
    if (delta) {
        const bf16 *dr = delta + r * hidden;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            const bf16 v = f2bf(bf2f(xr[i]) + bf2f(dr[i]));
            xr[i] = v;
            const float f = bf2f(v);
            sum += f * f;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            const float f = bf2f(xr[i]);
            sum += f * f;
        }
    }
    const float inv = 1.f / sqrtf(sum / (float)hidden + eps);
    bf16 *orow = out + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        orow[i] = f2bf(bf2f(weight[i]) * bf2f(f2bf(bf2f(xr[i]) * inv)));
}

void omniflow_add_rms_norm_bf16(bf16 *x, const bf16 *delta, const bf16 *weight, bf16 *out,
                                int64_t rows, int64_t hidden, float eps, int threads)
{
    const int parallel = rows * hidden > PARALLEL_ELEMENTS && threads > 1;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(dynamic, 32)
    for (int64_t r = 0; r < rows; r++) norm_row(x, delta, weight, out, r, hidden, eps);
}

/* Rotary embedding in place over `heads` heads of each row (q's and k's heads, adjacent in a
 * fused q/k/v row): x = x * cos + rotate_half(x) * sin, rounding each product and the sum as
 * PyTorch does. x: row r, head h at x + r * row_stride + h * dim; cos/sin: [rows, dim]. */
void rotary_row(bf16 *x, int64_t row_stride, int64_t r, int64_t heads, int64_t dim,
                const bf16 *cos, const bf16 *sin)
{
    const int64_t half = dim / 2;
    const bf16 *c = cos + r * dim, *s = sin + r * dim;
#if VECTOR_ROWS
    if (half % 16 == 0) {
        for (int64_t h = 0; h < heads; h++) {
            bf16 *v = x + r * row_stride + h * dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 lo = load16(v + i), hi = load16(v + half + i);
                const __m512 a = rounded(_mm512_mul_ps(lo, load16(c + i)));
                const __m512 b = rounded(_mm512_mul_ps(hi, load16(s + i)));
                const __m512 a2 = rounded(_mm512_mul_ps(hi, load16(c + half + i)));
                const __m512 b2 = rounded(_mm512_mul_ps(lo, load16(s + half + i)));
                store16(v + i, _mm512_sub_ps(a, b)); /* a + (-hi * sin) */
                store16(v + half + i, _mm512_add_ps(a2, b2));
            }
        }
        return;
    }
#endif
    for (int64_t h = 0; h < heads; h++) {
        bf16 *v = x + r * row_stride + h * dim;
        float lo[256], hi[256]; /* dim <= 512: checked by the caller */
        for (int64_t i = 0; i < half; i++) {
            lo[i] = bf2f(v[i]);
            hi[i] = bf2f(v[i + half]);
        }
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = bf2f(f2bf(lo[i] * bf2f(c[i])));
            const float b = bf2f(f2bf(-hi[i] * bf2f(s[i])));
            v[i] = f2bf(a + b);
            const float a2 = bf2f(f2bf(hi[i] * bf2f(c[i + half])));
            const float b2 = bf2f(f2bf(lo[i] * bf2f(s[i + half])));
            v[i + half] = f2bf(a2 + b2);
        }
    }
}

void omniflow_rotary_bf16(bf16 *x, int64_t row_stride, int64_t rows, int64_t heads,
                          int64_t dim, const bf16 *cos, const bf16 *sin, int threads)
{
    const int parallel = rows * heads * dim > PARALLEL_ELEMENTS && threads > 1;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(dynamic, 32)
    for (int64_t r = 0; r < rows; r++) rotary_row(x, row_stride, r, heads, dim, cos, sin);
}

/* Write each row's new K and V into the paged cache of one layer: row r, kv head h goes to
 * cache + h * head_stride + slots[r] * dim. k/v: row r, head h at k + r * row_stride + h * dim. */
void kv_write_row(const bf16 *k, const bf16 *v, int64_t row_stride, int64_t r,
                  int64_t kv_heads, int64_t dim, bf16 *cache_k, bf16 *cache_v,
                  int64_t head_stride, const int64_t *slots)
{
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t to = h * head_stride + slots[r] * dim, from = r * row_stride + h * dim;
        memcpy(cache_k + to, k + from, dim * sizeof(bf16));
        memcpy(cache_v + to, v + from, dim * sizeof(bf16));
    }
}

void omniflow_kv_write_bf16(const bf16 *k, const bf16 *v, int64_t row_stride, int64_t rows,
                            int64_t kv_heads, int64_t dim, bf16 *cache_k, bf16 *cache_v,
                            int64_t head_stride, const int64_t *slots, int threads)
{
    const int parallel = rows * kv_heads * dim > PARALLEL_ELEMENTS && threads > 1;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(dynamic, 32)
    for (int64_t r = 0; r < rows; r++)
        kv_write_row(k, v, row_stride, r, kv_heads, dim, cache_k, cache_v, head_stride, slots);
}

/* out = silu(gate) * up, rounded after the silu and after the product as PyTorch does.
 * gate_up: [rows, 2 * inter] (gate first), out: [rows, inter], both contiguous. */
void omniflow_silu_mul_bf16(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t inter,
                            int threads)
{
    const int parallel = rows * inter > PARALLEL_ELEMENTS && threads > 1;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(dynamic, 32)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *g = gate_up + r * 2 * inter, *u = g + inter;
        bf16 *o = out + r * inter;
#if VECTOR_ROWS
        if (inter % 16 == 0) {
            for (int64_t i = 0; i < inter; i += 16)
                store16(o + i, silu_mul16(load16(g + i), load16(u + i)));
            continue;
        }
#endif
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = bf2f(g[i]);
            const float silu = bf2f(f2bf(x / (1.f + expf(-x))));
            o[i] = f2bf(silu * bf2f(u[i]));
        }
    }
}
