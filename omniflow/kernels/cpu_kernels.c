/* omniflow's CPU kernels for a bf16 decoder step: what PyTorch runs as chains of small ops
 * (or, for decode attention, as a kernel built for long query blocks) done in one pass.
 *
 * Built by omniflow/kernels/cpu.py with the machine's C compiler (-O3 -march=native -fopenmp)
 * and called through ctypes. Loaded after torch, the library shares torch's OpenMP runtime.
 * Every kernel works in float32 and rounds to bf16 (nearest even) where PyTorch's op chain
 * rounds, except that a fused chain keeps float32 between its steps where noted.
 * Decode attention needs AVX-512 BF16; omniflow_decode_attention_supported() says whether
 * this build has it. The projections (omniflow_linear_bf16) need AMX; omniflow_amx_supported()
 * says whether this build and this kernel have it.
 */
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

/* A large finite stand-in for -inf (the library is built with -ffast-math). */
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
#else
#define VECTOR_ROWS 0
#endif

/* Rows above this many elements in all run on `threads` threads; below, one thread (forking
 * costs more than it saves on a decode step's 32 rows).
 *
 * Work is handed out dynamically (schedule(dynamic)), not split evenly up front: on a shared
 * machine one core is now and then much slower than the other (a busy sibling thread), and
 * an even split then waits on it. Measured on a 2-vCPU VM, llama-bench-30m engine runs paired
 * in-process: 2,048-row projections 30% shorter in a slow phase, the whole run 7-13%. */
#define PARALLEL_ELEMENTS (1 << 16)

/* x[r] += delta[r] (rounded, when delta is not NULL); out[r] = weight * rmsnorm(x[r]).
 * As transformers' RMSNorm: variance in float32, normalised value rounded to bf16, then
 * multiplied by the bf16 weight and rounded again. x, delta, out: [rows, hidden] contiguous. */
static void norm_row(bf16 *x, const bf16 *delta, const bf16 *weight, bf16 *out, int64_t r,
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
static void rotary_row(bf16 *x, int64_t row_stride, int64_t r, int64_t heads, int64_t dim,
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
static void kv_write_row(const bf16 *k, const bf16 *v, int64_t row_stride, int64_t r,
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

#if defined(__AVX512BF16__)

/* 16 vectors -> one vector of their 16 horizontal sums, in order. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v)
{
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A cursor over a row's context, token by token through its block table. */
typedef struct {
    const int64_t *table;
    int64_t page, offset, page_size, page_stride, dim;
} cursor;

static inline __attribute__((always_inline)) const bf16 *next_token(cursor *c, const bf16 *base)
{
    const bf16 *at = base + c->table[c->page] * c->page_stride + c->offset * c->dim;
    if (++c->offset == c->page_size) {
        c->offset = 0;
        c->page++;
    }
    return at;
}

static inline __attribute__((always_inline)) void prefetch_token(cursor *c, const bf16 *base)
{
    const char *at = (const char *)next_token(c, base);
    for (int64_t b = 0; b < c->dim * (int64_t)sizeof(bf16); b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
}

#define AHEAD 16

/* One (row, kv head): G query heads of D dims over n context tokens. Scores 16 tokens at a
 * time (dot products as bf16 pairs into float32, no horizontal sum per token), softmax in
 * float32, then the values accumulated in float32 and rounded once. */
static inline __attribute__((always_inline)) void attend(
    const bf16 *q, const bf16 *keys, const bf16 *values, cursor start, int64_t n, float scale,
    float *scores, bf16 *out, const int G, const int D)
{
    const int C = D / 32, L = D / 16;
    __m512bh qv[8][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(q + g * D + c * 32));
    const int64_t blocks = (n + 15) / 16, padded = blocks * 16;
    __m512 maxv[8];
    for (int g = 0; g < G; g++) maxv[g] = _mm512_set1_ps(MASKED);
    const __m512 vscale = _mm512_set1_ps(scale);
    cursor at = start, ahead = start;
    for (int64_t t = 0; t < AHEAD && t < n; t++) next_token(&ahead, keys);
    for (int64_t block = 0; block < blocks; block++) {
        __m512 part[8][16];
        for (int j = 0; j < 16; j++) {
            const int64_t t = block * 16 + j;
            if (t >= n) {
                for (int g = 0; g < G; g++) part[g][j] = _mm512_setzero_ps();
                continue;
            }
            const bf16 *k = next_token(&at, keys);
            if (t + AHEAD < n) prefetch_token(&ahead, keys);
            __m512bh kv[4];
            for (int c = 0; c < C; c++)
                kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(k + c * 32));
            for (int g = 0; g < G; g++) {
                __m512 acc = _mm512_setzero_ps();
                for (int c = 0; c < C; c++) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
                part[g][j] = acc;
            }
        }
        const int64_t left = n - block * 16;
        const __mmask16 valid = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_mul_ps(hsum16(part[g]), vscale);
            s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(MASKED), s);
            _mm512_storeu_ps(scores + g * padded + block * 16, s);
            maxv[g] = _mm512_max_ps(maxv[g], s);
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * padded;
        const float m = _mm512_reduce_max_ps(maxv[g]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < padded; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < padded; t++) sg[t] *= inv;
    }
    __m512 acc[8][8];
    for (int g = 0; g < G; g++)
        for (int l = 0; l < L; l++) acc[g][l] = _mm512_setzero_ps();
    at = start;
    ahead = start;
    for (int64_t t = 0; t < AHEAD && t < n; t++) next_token(&ahead, values);
    for (int64_t t = 0; t < n; t++) {
        const bf16 *v = next_token(&at, values);
        if (t + AHEAD < n) prefetch_token(&ahead, values);
        __m512 vf[8];
        for (int l = 0; l < L; l++)
            vf[l] = load16(v + l * 16);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * padded + t]);
            for (int l = 0; l < L; l++) acc[g][l] = _mm512_fmadd_ps(p, vf[l], acc[g][l]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int l = 0; l < L; l++)
            store16(out + g * D + l * 16, acc[g][l]);
}

#define ATTEND(G, D)                                                                  \
    if (group == G && dim == D) {                                                     \
        attend(qr, kh, vh, start, n, scale, scores, o, G, D);                         \
        continue;                                                                     \
    }
#define ATTEND_GROUPS(D) \
    ATTEND(1, D) ATTEND(2, D) ATTEND(3, D) ATTEND(4, D) ATTEND(5, D) ATTEND(6, D) ATTEND(7, D) ATTEND(8, D)

/* A thread's buffer for one task's scores: `group` rows of up to `widest` context tokens. */
static float *attention_scores(int64_t group, int64_t widest)
{
    const size_t bytes = sizeof(float) * (size_t)(group * (widest + 16));
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* The (row, kv head) tasks of decode attention, shared out among the threads of the
 * enclosing parallel region (or run by the caller alone outside one). */
static void attention_body(const bf16 *q, int64_t q_row, const bf16 *keys, const bf16 *values,
                           int64_t head_stride, int64_t page_stride, int64_t page_size,
                           const int64_t *tables, int64_t table_width, const int64_t *lengths,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                           bf16 *out, float *scores)
{
    const int64_t group = heads / kv_heads;
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < rows * kv_heads; task++) {
        const int64_t r = task / kv_heads, h = task % kv_heads, n = lengths[r];
        const cursor start = {tables + r * table_width, 0, 0, page_size, page_stride, dim};
        const bf16 *qr = q + r * q_row + h * group * dim;
        const bf16 *kh = keys + h * head_stride, *vh = values + h * head_stride;
        bf16 *o = out + (r * heads + h * group) * dim;
        ATTEND_GROUPS(32)
        ATTEND_GROUPS(64)
        ATTEND_GROUPS(128)
    }
}

#endif /* __AVX512BF16__ */

/* Whether decode attention runs here for query heads per kv head `group` and head size `dim`. */
int omniflow_decode_attention_supported(int64_t group, int64_t dim)
{
#if defined(__AVX512BF16__)
    return group >= 1 && group <= 8 && (dim == 32 || dim == 64 || dim == 128);
#else
    (void)group;
    (void)dim;
    return 0;
#endif
}

/* Decode attention: one new query token per row over its context in the paged cache.
 * q: row r, head h at q + r * q_row + h * dim; out: [rows, heads, dim] contiguous.
 * keys/values: token o of page p, kv head h at base + h * head_stride + p * page_stride + o * dim.
 * tables: [rows, table_width] page ids; lengths: [rows] context tokens (>= 1). Query head h reads
 * kv head h / (heads / kv_heads), as transformers' repeat_kv. Returns -1, doing nothing, where
 * omniflow_decode_attention_supported() is false. */
int omniflow_decode_attention_bf16(const bf16 *q, int64_t q_row, const bf16 *keys,
                                   const bf16 *values, int64_t head_stride, int64_t page_stride,
                                   int64_t page_size, const int64_t *tables, int64_t table_width,
                                   const int64_t *lengths, int64_t rows, int64_t heads,
                                   int64_t kv_heads, int64_t dim, float scale, bf16 *out,
                                   int threads)
{
    const int64_t group = heads / kv_heads;
    if (!omniflow_decode_attention_supported(group, dim) || group * kv_heads != heads) return -1;
#if defined(__AVX512BF16__)
    int64_t widest = 1;
    for (int64_t r = 0; r < rows; r++)
        if (lengths[r] > widest) widest = lengths[r];
#pragma omp parallel num_threads(threads)
    {
        float *scores = attention_scores(group, widest);
        attention_body(q, q_row, keys, values, head_stride, page_stride, page_size, tables,
                       table_width, lengths, rows, heads, kv_heads, dim, scale, out, scores);
        free(scores);
    }
    return 0;
#else
    return -1;
#endif
}

/* Projections on AMX tiles. A weight [N, K] is re-laid once (omniflow/kernels/cpu.py,
 * pack_linear) as blocks of 32 output columns: block b, k-block kb (32 inputs) holds two
 * 16 x 16 x 2 tiles, half h's row kk, column n, pair p = W[column(b, h, n)][kb * 32 + 2 kk + p],
 * zero past N and K. Plain weights: column(b, h, n) = 32 b + 16 h + n. A fused gate/up weight
 * ([gate; up], `inter` rows each): half 0 is gate row 16 b + n, half 1 up row inter + 16 b + n,
 * so one block holds both halves of 16 columns of silu(gate) * up. Each block of 32 rows of x
 * is two A tiles, read in place for a decode step's 32 rows, else from a copy made once per
 * task (tile_rows); four C tiles accumulate in float32 and are rounded once, as a oneDNN bf16
 * GEMM does. */

int omniflow_amx_supported(void)
{
#if AMX
    /* Linux grants a process the AMX tile state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

#if AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Rows of x per task: a task's rows stay in cache while it walks its blocks of columns. */
#define TASK_ROWS 256

/* The 16 values of one C tile row, rounded, to out[0..min(count, 16)). */
static inline __attribute__((always_inline)) void store_upto16(bf16 *out, __m512 v, int64_t count)
{
    if (count >= 16)
        store16(out, v);
    else if (count > 0)
        _mm256_mask_storeu_epi16(out, (__mmask16)((1u << count) - 1), (__m256i)_mm512_cvtneps_pbh(v));
}

/* Rows [first, last) of x as A tiles, contiguous: 32-row block i, k-block kb at
 * tiles + (i * kblocks + kb) * 1024, its rows 0-15 then 16-31, 32 inputs a row; zero past
 * `last` and K. Tile loads then read whole lines in order, and edges need no other path. */
static void tile_rows(const bf16 *x, int64_t lda, int64_t first, int64_t last, int64_t K,
                      int64_t kblocks, bf16 *tiles)
{
    const int64_t padded_rows = (last - first + 31) / 32 * 32;
    for (int64_t r = 0; r < padded_rows; r++) {
        bf16 *row = tiles + r / 32 * kblocks * 1024 + r % 32 * 32;
        for (int64_t kb = 0; kb < kblocks; kb++) {
            const int64_t left = K - kb * 32;
            const __mmask32 mask = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
            const __m512i v = first + r < last
                                  ? _mm512_maskz_loadu_epi16(mask, x + (first + r) * lda + kb * 32)
                                  : _mm512_setzero_si512();
            _mm512_store_si512(row + kb * 1024, v);
        }
    }
}

static inline __attribute__((always_inline)) __m512 bias_upto16(const bf16 *bias, int64_t count)
{
    if (count <= 0) return _mm512_setzero_ps();
    const __mmask16 mask = count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1);
    return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias));
}

/* One 32 x 32 block of C (float32, [32 rows][32 columns], half h's columns at 16 h) out:
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

/* A thread's AMX state for the projections of one parallel region: tiles configured once,
 * two C blocks, and room for TASK_ROWS rows of x as tiles of up to `tile_k` inputs (0: none,
 * every projection reads its rows in place). */
typedef struct {
    float c[2 * 32 * 32] __attribute__((aligned(64)));
    bf16 *tiles;
} amx_scratch;

static void amx_begin(amx_scratch *scratch, int64_t tile_k)
{
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    scratch->tiles = tile_k ? aligned_alloc(64, sizeof(bf16) * TASK_ROWS * ((tile_k + 31) / 32) * 32)
                            : NULL;
}

static void amx_end(amx_scratch *scratch)
{
    free(scratch->tiles);
    _tile_release();
}

/* How far ahead (in 2 KB k-blocks of weight tiles) a projection over few rows prefetches.
 * Measured on a 2-vCPU AMX VM, llama-bench-30m engine runs paired in-process (medians of
 * 6-10 pairs): whole runs 2-8% shorter in three of four comparisons, 2% longer in one;
 * 16 k-blocks ahead no better than 8. */
#define PREFETCH_KBLOCKS 8

/* A decode step's 32 rows are read in place (a copy costs more than it saves there); more
 * rows, or rows off the 32 x 32 grid, as tiles (tile_rows). */
static int reads_in_place(int64_t rows, int64_t K)
{
    return rows == 32 && K % 32 == 0;
}

/* omniflow_linear_bf16's blocks, shared out among the threads of the enclosing parallel
 * region, each with its amx_begin'd scratch (tiles for K inputs unless reads_in_place). */
static void linear_body(const bf16 *x, int64_t lda, int64_t rows, int64_t K, const bf16 *packed,
                        int64_t N, int64_t inter, int silu, const bf16 *bias, bf16 *out,
                        int64_t ldo, amx_scratch *scratch)
{
    const int64_t kblocks = (K + 31) / 32;
    const int64_t blocks = inter > 0 ? (inter + 15) / 16 : (N + 31) / 32;
    const int64_t tasks = (rows + TASK_ROWS - 1) / TASK_ROWS;
    const int in_place = reads_in_place(rows, K);
    /* Up to 32 rows, each weight tile serves one block of rows: the weights stream through
     * once, and tile loads alone leave the memory latency exposed. */
    const int streaming = rows <= 32;
    const int64_t a_step = in_place ? 32 : 1024, a_half = in_place ? 16 * lda : 512;
    const size_t a_stride = in_place ? (size_t)lda * sizeof(bf16) : 64;
    int64_t tiled = -1; /* the task whose rows `tiles` holds */
#pragma omp for collapse(2) schedule(dynamic, 2)
    for (int64_t task = 0; task < tasks; task++)
        for (int64_t b = 0; b < blocks; b++) {
            const bf16 *w = packed + b * kblocks * 1024;
            const int64_t first = task * TASK_ROWS;
            const int64_t last = first + TASK_ROWS < rows ? first + TASK_ROWS : rows;
            if (!in_place && task != tiled) { /* once per task and thread */
                tile_rows(x, lda, first, last, K, kblocks, scratch->tiles);
                tiled = task;
            }
            int64_t pending = -1; /* the 32 rows whose C block awaits store_block */
            int half = 0;         /* which of c's two blocks this one's C goes to */
            for (int64_t m0 = first; m0 < last; m0 += 32) {
                const int64_t m = last - m0 < 32 ? last - m0 : 32;
                const bf16 *a =
                    in_place ? x + m0 * lda : scratch->tiles + (m0 - first) / 32 * kblocks * 1024;
                const int both = m > 16;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < kblocks; kb++) {
                    if (streaming) /* the weight tiles PREFETCH_KBLOCKS ahead (past the block's
                                      end: the next block's, which this thread likely takes) */
                        for (int line = 0; line < 32; line++)
                            _mm_prefetch((const char *)(w + (kb + PREFETCH_KBLOCKS) * 1024 + line * 32),
                                         _MM_HINT_T0);
                    _tile_loadd(4, a + kb * a_step, a_stride);
                    _tile_loadd(6, w + kb * 1024, 64);
                    _tile_loadd(7, w + kb * 1024 + 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (both) {
                        _tile_loadd(5, a + kb * a_step + a_half, a_stride);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                /* The last block's rounding and stores while the AMX unit works on this
                 * one's sums: issued after them, they overlap in the core. */
                if (pending >= 0)
                    store_block(scratch->c + (1 - half) * 1024, last - pending < 32 ? last - pending : 32,
                                pending, b, N, inter, silu, bias, out, ldo);
                _tile_stored(0, scratch->c + half * 1024, 128);
                _tile_stored(1, scratch->c + half * 1024 + 16, 128);
                _tile_stored(2, scratch->c + half * 1024 + 16 * 32, 128);
                _tile_stored(3, scratch->c + half * 1024 + 16 * 32 + 16, 128);
                pending = m0;
                half = 1 - half;
            }
            store_block(scratch->c + (1 - half) * 1024, last - pending < 32 ? last - pending : 32, pending,
                        b, N, inter, silu, bias, out, ldo);
        }
}

#endif

/* out = x @ W.T (+ bias), x [rows, K] (row stride lda), out [rows, ldo-strided], W packed as
 * above (`inter` > 0: a fused gate/up weight; then `silu` writes silu(gate) * up [rows, inter],
 * else gate | up [rows, 2 * inter]). bias: per output column of W, or NULL. Returns -1, doing
 * nothing, where omniflow_amx_supported() is false. */
int omniflow_linear_bf16(const bf16 *x, int64_t lda, int64_t rows, int64_t K, const bf16 *packed,
                         int64_t N, int64_t inter, int silu, const bf16 *bias, bf16 *out,
                         int64_t ldo, int threads)
{
#if AMX
#pragma omp parallel num_threads(threads)
    {
        amx_scratch scratch;
        amx_begin(&scratch, reads_in_place(rows, K) ? 0 : K);
        linear_body(x, lda, rows, K, packed, N, inter, silu, bias, out, ldo, &scratch);
        amx_end(&scratch);
    }
    return 0;
#else
    (void)x, (void)lda, (void)rows, (void)K, (void)packed, (void)N, (void)inter, (void)silu;
    (void)bias, (void)out, (void)ldo, (void)threads;
    return -1;
#endif
}

/* What omniflow_decode_layers_bf16 reads of each layer: one int64 address each (0: no bias). */
enum {
    L_NORM,
    L_QKV,
    L_QKV_BIAS,
    L_O,
    L_O_BIAS,
    L_POST_NORM,
    L_GATE_UP,
    L_GATE_UP_BIAS,
    L_DOWN,
    L_DOWN_BIAS,
    L_KEYS,
    L_VALUES,
    L_FIELDS
};

int omniflow_decode_layer_fields(void)
{
    return L_FIELDS;
}

/* A decode step's decoder layers (one new token a row) in one parallel region instead of ~9
 * calls a layer: per layer the norm with the last layer's output added into x, the q/k/v
 * projection, rotary, the new K/V into the pages at slots, attention over the pages, the
 * output projection, the norm with it added, gate/up with silu * up, the down projection;
 * then x += the last layer's output. The same kernels as the calls one by one, in the same
 * order: the same values. x: [rows, hidden] contiguous, updated in place; layer: [layers]
 * [L_FIELDS] (projections packed as for omniflow_linear_bf16, the layer's key and value pages
 * as for omniflow_decode_attention_bf16); cos/sin: [rows, dim]; scratch: bf16 room for
 * rows x (2 hidden + (heads + 2 kv_heads) dim + heads dim + inter). Returns -1, doing
 * nothing, where AMX or decode attention for these heads is not in this build. */
int omniflow_decode_layers_bf16(bf16 *x, int64_t rows, int64_t layers, const int64_t *layer,
                                int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t inter, float eps, float scale, int64_t head_stride,
                                int64_t page_stride, int64_t page_size, const bf16 *cos,
                                const bf16 *sin, const int64_t *slots, const int64_t *tables,
                                int64_t table_width, const int64_t *lengths, bf16 *scratch,
                                int threads)
{
    const int64_t group = heads / kv_heads;
    if (!omniflow_decode_attention_supported(group, dim) || group * kv_heads != heads) return -1;
#if AMX
    const int64_t q_size = heads * dim, qkv_size = (heads + 2 * kv_heads) * dim;
    bf16 *h = scratch, *qkv = h + rows * hidden, *attended = qkv + rows * qkv_size;
    bf16 *gated = attended + rows * q_size, *delta = gated + rows * inter;
    int64_t widest = 1, tile_k = 0;
    for (int64_t r = 0; r < rows; r++)
        if (lengths[r] > widest) widest = lengths[r];
    const int64_t inputs[3] = {hidden, q_size, inter};
    for (int i = 0; i < 3; i++)
        if (!reads_in_place(rows, inputs[i]) && inputs[i] > tile_k) tile_k = inputs[i];
#define AT(field) ((bf16 *)(intptr_t)w[field])
#pragma omp parallel num_threads(threads)
    {
        amx_scratch amx;
        amx_begin(&amx, tile_k);
        float *scores = attention_scores(group, widest);
        for (int64_t l = 0; l < layers; l++) {
            const int64_t *w = layer + l * L_FIELDS;
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; r++)
                norm_row(x, l ? delta : NULL, AT(L_NORM), h, r, hidden, eps);
            linear_body(h, hidden, rows, hidden, AT(L_QKV), qkv_size, 0, 0, AT(L_QKV_BIAS), qkv,
                        qkv_size, &amx);
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; r++) {
                rotary_row(qkv, qkv_size, r, heads + kv_heads, dim, cos, sin);
                kv_write_row(qkv + q_size, qkv + q_size + kv_heads * dim, qkv_size, r, kv_heads,
                             dim, AT(L_KEYS), AT(L_VALUES), head_stride, slots);
            }
            attention_body(qkv, qkv_size, AT(L_KEYS), AT(L_VALUES), head_stride, page_stride,
                           page_size, tables, table_width, lengths, rows, heads, kv_heads, dim,
                           scale, attended, scores);
            linear_body(attended, q_size, rows, q_size, AT(L_O), hidden, 0, 0, AT(L_O_BIAS), delta,
                        hidden, &amx);
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; r++)
                norm_row(x, delta, AT(L_POST_NORM), h, r, hidden, eps);
            linear_body(h, hidden, rows, hidden, AT(L_GATE_UP), 2 * inter, inter, 1,
                        AT(L_GATE_UP_BIAS), gated, inter, &amx);
            linear_body(gated, inter, rows, inter, AT(L_DOWN), hidden, 0, 0, AT(L_DOWN_BIAS), delta,
                        hidden, &amx);
        }
#pragma omp for schedule(dynamic, 8)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hidden; i++)
                x[r * hidden + i] = f2bf(bf2f(x[r * hidden + i]) + bf2f(delta[r * hidden + i]));
        free(scores);
        amx_end(&amx);
    }
#undef AT
    return 0;
#else
    (void)x, (void)rows, (void)layers, (void)layer, (void)hidden, (void)inter, (void)eps;
    (void)scale, (void)head_stride, (void)page_stride, (void)page_size, (void)cos, (void)sin;
    (void)slots, (void)tables, (void)table_width, (void)lengths, (void)scratch, (void)threads;
    return -1;
#endif
}

#if AMX
/* 16 x 16 transpose of 32-bit lanes in registers: r[i] lane j -> r[j] lane i. */
static inline __attribute__((always_inline)) void transpose16x16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* Token j of the sequence whose pages are `table`: its row of one kv head's pages. */
static inline const bf16 *page_row(const bf16 *base, const int64_t *table, int64_t j,
                                   int64_t page_size, int64_t page_stride, int64_t dim)
{
    return base + table[j / page_size] * page_stride + (j % page_size) * dim;
}
#endif

/* Whether omniflow_context_attention_bf16 runs here for these heads. */
int omniflow_context_attention_supported(int64_t heads, int64_t kv_heads, int64_t dim)
{
    return AMX && kv_heads > 0 && heads % kv_heads == 0 && dim % 32 == 0 && dim <= 128;
}

#if AMX
/* A thread's buffers for attend_chunk over up to `width` keys (a multiple of 32). */
typedef struct {
    bf16 *kt, *vv, *p, *qa;
    float *s;
} chunk_scratch;

static void chunk_begin(chunk_scratch *b, int64_t width, int64_t dim)
{
    b->kt = aligned_alloc(64, sizeof(bf16) * width * dim);
    b->vv = aligned_alloc(64, sizeof(bf16) * width * dim);
    b->s = aligned_alloc(64, sizeof(float) * 16 * width);
    b->p = aligned_alloc(64, sizeof(bf16) * 16 * width);
    b->qa = aligned_alloc(64, sizeof(bf16) * 16 * dim);
}

static void chunk_end(chunk_scratch *b)
{
    free(b->kt);
    free(b->vv);
    free(b->s);
    free(b->p);
    free(b->qa);
}

/* One kv head of one sequence: its `chunk` new tokens (positions start..) attend keys
 * 0..their own position. The head's keys are laid once as B tiles of K^T (16 keys x 16 dim
 * pairs) and its values as B tiles of V (16 key pairs x 16 dims); per query head and block of
 * 16 tokens the scores are tile products in float32, the softmax float32 with the
 * probabilities rounded to bf16 (as PyTorch's attention rounds them before the values), the
 * output accumulated in float32 and rounded once. Key j of the head at
 * page_row(kh or vh, table, j, ...); q: token t, query head h at q + t * q_row + h * dim;
 * out: token t, head h at out + (t * heads + h) * dim. */
static void attend_chunk(const bf16 *q, int64_t q_row, const bf16 *kh, const bf16 *vh,
                         const int64_t *table, int64_t page_size, int64_t page_stride,
                         int64_t start, int64_t chunk, int64_t kv_head, int64_t heads,
                         int64_t group, int64_t dim, float scale, bf16 *out, chunk_scratch *b,
                         amx_scratch *amx)
{
    const int64_t n = start + chunk, blocks16 = (n + 15) / 16, width = (n + 31) / 32 * 32;
    const int64_t chunks32 = dim / 32, chunks16 = dim / 16;
    bf16 *kt = b->kt, *vv = b->vv, *p = b->p, *qa = b->qa;
    float *s = b->s;
    for (int64_t k = 0; k < blocks16; k++) /* K^T: tile row kk = every key's dim pair kk */
        for (int64_t c = 0; c < chunks32; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t j = k * 16 + i;
                r[i] = j < n ? _mm512_loadu_si512(page_row(kh, table, j, page_size, page_stride, dim) + c * 32)
                             : _mm512_setzero_si512();
            }
            transpose16x16(r);
            for (int kk = 0; kk < 16; kk++) _mm512_store_si512(kt + ((k * chunks32 + c) * 16 + kk) * 32, r[kk]);
        }
    /* V: tile row kk = 16 dims of keys 2 kk and 2 kk + 1, interleaved */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t k = 0; k < width / 32; k++)
        for (int kk = 0; kk < 16; kk++) {
            const int64_t j = k * 32 + 2 * kk;
            const bf16 *even = j < n ? page_row(vh, table, j, page_size, page_stride, dim) : NULL;
            const bf16 *odd = j + 1 < n ? page_row(vh, table, j + 1, page_size, page_stride, dim) : NULL;
            for (int64_t c = 0; c < chunks16; c++) {
                const __m256i lo = even ? _mm256_loadu_si256((const void *)(even + c * 16)) : _mm256_setzero_si256();
                const __m256i hi = odd ? _mm256_loadu_si256((const void *)(odd + c * 16)) : _mm256_setzero_si256();
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                _mm512_store_si512(vv + ((k * chunks16 + c) * 16 + kk) * 32, _mm512_permutexvar_epi16(pairs, both));
            }
        }
    for (int64_t g = 0; g < group; g++)
        for (int64_t t0 = 0; t0 < chunk; t0 += 16) {
            const int64_t rows = chunk - t0 < 16 ? chunk - t0 : 16, head = kv_head * group + g;
            for (int i = 0; i < 16; i++)
                for (int64_t d = 0; d < dim; d += 32)
                    _mm512_store_si512(qa + i * dim + d, i < rows ? _mm512_loadu_si512(q + (t0 + i) * q_row + head * dim + d)
                                                                  : _mm512_setzero_si512());
            const int64_t seen = start + t0 + rows; /* keys the block's last token sees */
            const int64_t used16 = (seen + 15) / 16, used32 = (seen + 31) / 32;
            for (int64_t k = 0; k < used16; k++) {
                _tile_zero(0);
                for (int64_t c = 0; c < chunks32; c++) {
                    _tile_loadd(1, qa + c * 32, dim * sizeof(bf16));
                    _tile_loadd(2, kt + (k * chunks32 + c) * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, s + k * 16, width * sizeof(float));
            }
            const __m512 vscale = _mm512_set1_ps(scale);
            for (int64_t i = 0; i < 16; i++) { /* softmax over the keys row i sees, 16 at a time */
                bf16 *pi = p + i * width;
                float *si = s + i * width;
                const int64_t valid = i < rows ? start + t0 + i + 1 : 0;
                __m512 top = _mm512_set1_ps(MASKED), sum = _mm512_setzero_ps();
                for (int64_t k = 0; k < valid; k += 16) {
                    const __mmask16 in = valid - k >= 16 ? 0xffff : (__mmask16)((1u << (valid - k)) - 1);
                    top = _mm512_mask_max_ps(top, in, top, _mm512_mul_ps(_mm512_loadu_ps(si + k), vscale));
                }
                const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
                for (int64_t k = 0; k < valid; k += 16) {
                    const __mmask16 in = valid - k >= 16 ? 0xffff : (__mmask16)((1u << (valid - k)) - 1);
                    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(si + k), vscale), max));
                    _mm512_storeu_ps(si + k, e);
                    sum = _mm512_mask_add_ps(sum, in, sum, e);
                }
                const __m512 inv = _mm512_set1_ps(valid ? 1.f / _mm512_reduce_add_ps(sum) : 0.f);
                for (int64_t k = 0; k < used32 * 32; k += 16) {
                    const int64_t left = valid - k;
                    const __mmask16 in = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                    const __m512 probs = _mm512_maskz_mul_ps(in, _mm512_loadu_ps(si + k), inv);
                    store16(pi + k, probs);
                }
            }
            for (int64_t c0 = 0; c0 < chunks16; c0 += 4) {
                const int64_t parts = chunks16 - c0 < 4 ? chunks16 - c0 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t k = 0; k < used32; k++) {
                    _tile_loadd(4, p + k * 32, width * sizeof(bf16));
                    const bf16 *v = vv + (k * chunks16 + c0) * 512;
                    _tile_loadd(5, v, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (parts > 1) {
                        _tile_loadd(5, v + 512, 64);
                        _tile_dpbf16ps(1, 4, 5);
                    }
                    if (parts > 2) {
                        _tile_loadd(5, v + 1024, 64);
                        _tile_dpbf16ps(2, 4, 5);
                    }
                    if (parts > 3) {
                        _tile_loadd(5, v + 1536, 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, amx->c, 64);
                _tile_stored(1, amx->c + 256, 64);
                _tile_stored(2, amx->c + 512, 64);
                _tile_stored(3, amx->c + 768, 64);
                for (int64_t j = 0; j < parts; j++)
                    for (int64_t i = 0; i < rows; i++)
                        store16(out + ((t0 + i) * heads + head) * dim + (c0 + j) * 16, _mm512_load_ps(amx->c + j * 256 + i * 16));
            }
        }
}
#endif

/* Causal attention of `count` chunks of `chunk` new tokens each, each chunk over its
 * sequence's context and itself (their K/V already in place), on AMX: attend_chunk per
 * (chunk, kv head) on the threads. Token t of chunk c, at position start + t, attends keys
 * 0..start + t. q: that token's head h at q + (c * chunk + t) * q_row + h * dim; out:
 * [count * chunk, heads, dim]. Key j of chunk c's kv head h at
 * keys + c * kv_step + h * head_stride + table[j / page_size] * page_stride + (j % page_size) * dim
 * (values alike): a sequence's pages (count 1), or prompts without cached context whose K/V
 * rows sit where the q/k/v projection left them (table[j] = j, page_size 1, page_stride the
 * row stride, kv_step a prompt's rows). Returns -1, doing nothing, where
 * omniflow_context_attention_supported is false. */
int omniflow_chunk_attention_bf16(const bf16 *q, int64_t q_row, const bf16 *keys,
                                  const bf16 *values, int64_t head_stride, int64_t page_stride,
                                  int64_t page_size, const int64_t *table, int64_t kv_step,
                                  int64_t start, int64_t chunk, int64_t count, int64_t heads,
                                  int64_t kv_heads, int64_t dim, float scale, bf16 *out,
                                  int threads)
{
    if (!omniflow_context_attention_supported(heads, kv_heads, dim)) return -1;
#if AMX
    const int64_t width = (start + chunk + 31) / 32 * 32;
#pragma omp parallel num_threads(threads)
    {
        amx_scratch amx;
        chunk_scratch buffers;
        amx_begin(&amx, 0);
        chunk_begin(&buffers, width, dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < count * kv_heads; task++) {
            const int64_t c = task / kv_heads, h = task % kv_heads;
            const int64_t kv = c * kv_step + h * head_stride;
            attend_chunk(q + c * chunk * q_row, q_row, keys + kv, values + kv, table, page_size,
                         page_stride, start, chunk, h, heads, heads / kv_heads, dim, scale,
                         out + c * chunk * heads * dim, &buffers, &amx);
        }
        chunk_end(&buffers);
        amx_end(&amx);
    }
    return 0;
#else
    (void)q, (void)q_row, (void)keys, (void)values, (void)head_stride, (void)page_stride;
    (void)page_size, (void)table, (void)kv_step, (void)start, (void)chunk, (void)count;
    (void)scale, (void)out, (void)threads;
    return -1;
#endif
}
