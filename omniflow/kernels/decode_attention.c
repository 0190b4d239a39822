/* Decode attention: one new query token per row over its context, read in place from the
 * paged cache (AVX-512 BF16). */
#include "cpu_kernels.h"

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
float *attention_scores(int64_t group, int64_t widest)
{
    const size_t bytes = sizeof(float) * (size_t)(group * (widest + 16));
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* The (row, kv head) tasks of decode attention, shared out among the threads of the
 * enclosing parallel region (or run by the caller alone outside one). */
void attention_body(const bf16 *q, int64_t q_row, const bf16 *keys, const bf16 *values,
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
