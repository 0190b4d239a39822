/* Prefill attention: chunks of new tokens over their cached context and themselves, on AMX
 * tiles or, without AMX, on AVX-512 BF16 dot products over the same layouts. */
#include "cpu_kernels.h"

#if VECTOR_ROWS
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

/* e^x for x <= 0, 16 lanes (x below -87 gives 0): 2^(x log2 e) as 2^n times a degree-6
 * polynomial for 2^f, |f| <= 1/2, within ~2e-7 relative of e^x. The softmax's probabilities
 * are rounded to bf16 (8 bits), and this costs a third of libmvec's expf. */
static inline __attribute__((always_inline)) __m512 exp16_nonpositive(__m512 x)
{
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Token j of the sequence whose pages are `table`: its row of one kv head's pages. */
static inline const bf16 *page_row(const bf16 *base, const int64_t *table, int64_t j,
                                   int64_t page_size, int64_t page_stride, int64_t dim)
{
    return base + table[j / page_size] * page_stride + (j % page_size) * dim;
}
#endif

/* Whether omniflow_chunk_attention_bf16 runs here for these heads (with AMX or without). */
int omniflow_context_attention_supported(int64_t heads, int64_t kv_heads, int64_t dim)
{
    return VECTOR_ROWS && kv_heads > 0 && heads % kv_heads == 0 && dim % 32 == 0 && dim <= 128;
}

#if VECTOR_ROWS
/* A thread's buffers for attend_chunk over up to `width` keys (a multiple of 32). */
typedef struct {
    bf16 *kt, *vv, *p, *qa;
    float *s, *c;
} chunk_scratch;

static void chunk_begin(chunk_scratch *b, int64_t width, int64_t dim)
{
    b->kt = aligned_alloc(64, sizeof(bf16) * width * dim);
    b->vv = aligned_alloc(64, sizeof(bf16) * width * dim);
    b->s = aligned_alloc(64, sizeof(float) * 16 * width);
    b->p = aligned_alloc(64, sizeof(bf16) * 16 * width);
    b->qa = aligned_alloc(64, sizeof(bf16) * 16 * dim);
    b->c = aligned_alloc(64, sizeof(float) * 16 * 64);
}

static void chunk_end(chunk_scratch *b)
{
    free(b->kt);
    free(b->vv);
    free(b->s);
    free(b->p);
    free(b->qa);
    free(b->c);
}

/* The bf16 pair at p (two adjacent values) in every lane. */
static inline __attribute__((always_inline)) __m512bh pair16(const bf16 *p)
{
    int32_t both;
    memcpy(&both, p, sizeof both);
    return (__m512bh)_mm512_set1_epi32(both);
}

/* Scores of R query rows (qa, `dim` apart) against C blocks of 16 keys from key block k0 of
 * kt (as attend_chunk lays it), float32, to s (rows `width` apart): per dim pair, one
 * broadcast of each row's pair and one load of each block's, R x C dot products. */
static inline __attribute__((always_inline)) void scores_vector(
    const bf16 *qa, const bf16 *kt, int64_t k0, int64_t dim, float *s, int64_t width,
    const int R, const int C)
{
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const bf16 *keys = kt + k0 * 16 * dim;
    for (int64_t pair = 0; pair < dim / 2; pair++) {
        __m512bh kv[4];
        for (int c = 0; c < C; c++) kv[c] = (__m512bh)_mm512_load_si512(keys + (c * dim / 2 + pair) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh qv = pair16(qa + r * dim + 2 * pair);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(s + r * width + (k0 + c) * 16, acc[r][c]);
}

/* Outputs of R rows of probabilities (p, `width` apart) over `pairs` pairs of keys, for 16 x C
 * dims from chunk c0 of vv (as attend_chunk lays it), float32, to c (rows 64 apart, chunk
 * c0 + c at 16 c). */
static inline __attribute__((always_inline)) void values_vector(
    const bf16 *p, int64_t width, const bf16 *vv, int64_t chunks16, int64_t c0, int64_t pairs,
    float *out, const int R, const int C)
{
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        const bf16 *v = vv + ((j / 16 * chunks16 + c0) * 16 + j % 16) * 32;
        __m512bh vl[4];
        for (int c = 0; c < C; c++) vl[c] = (__m512bh)_mm512_load_si512(v + c * 512);
        for (int r = 0; r < R; r++) {
            const __m512bh pv = pair16(p + r * width + 2 * j);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vl[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_store_ps(out + r * 64 + c * 16, acc[r][c]);
}

/* One kv head of one sequence: its new tokens first..last - 1 of the chunk (positions
 * start + first..) attend keys 0..their own position. The keys the slab's last token sees are
 * laid once as K^T in 16 keys x 16 dim pairs (an AMX B tile; per pair one vector of
 * 16 keys) and its values as V in 16 key pairs x 16 dims (per key pair one vector of 16
 * dims); per query head and block of 16 tokens the scores are tile products or, without AMX
 * (amx 0) bf16 dot products in float32, the softmax float32 with the probabilities
 * rounded to bf16 (as PyTorch's attention rounds them before the values), the output
 * accumulated in float32 and rounded once. Key j of the head at page_row(kh or vh, table,
 * j, ...); q: token t, query head h at q + t * q_row + h * dim; out: token t, head h at
 * out + (t * heads + h) * dim. */
static void attend_chunk(const bf16 *q, int64_t q_row, const bf16 *kh, const bf16 *vh,
                         const int64_t *table, int64_t page_size, int64_t page_stride,
                         int64_t start, int64_t first, int64_t last, int64_t kv_head,
                         int64_t heads, int64_t group, int64_t dim, float scale, bf16 *out,
                         chunk_scratch *b, int amx)
{
    const int64_t n = start + last, blocks16 = (n + 15) / 16, width = (n + 31) / 32 * 32;
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
        for (int64_t t0 = first; t0 < last; t0 += 16) {
            const int64_t rows = last - t0 < 16 ? last - t0 : 16, head = kv_head * group + g;
            for (int i = 0; i < 16; i++)
                for (int64_t d = 0; d < dim; d += 32)
                    _mm512_store_si512(qa + i * dim + d, i < rows ? _mm512_loadu_si512(q + (t0 + i) * q_row + head * dim + d)
                                                                  : _mm512_setzero_si512());
            const int64_t seen = start + t0 + rows; /* keys the block's last token sees */
            const int64_t used16 = (seen + 15) / 16, used32 = (seen + 31) / 32;
            const int64_t rows4 = (rows + 3) / 4 * 4;
#if AMX
            if (amx) {
                for (int64_t k = 0; k < used16; k++) {
                    _tile_zero(0);
                    for (int64_t c = 0; c < chunks32; c++) {
                        _tile_loadd(1, qa + c * 32, dim * sizeof(bf16));
                        _tile_loadd(2, kt + (k * chunks32 + c) * 512, 64);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                    _tile_stored(0, s + k * 16, width * sizeof(float));
                }
            } else
#endif
            {
                for (int64_t i = 0; i < rows4; i += 4) {
                    int64_t k = 0;
                    for (; k + 4 <= used16; k += 4) scores_vector(qa + i * dim, kt, k, dim, s + i * width, width, 4, 4);
                    for (; k < used16; k++) scores_vector(qa + i * dim, kt, k, dim, s + i * width, width, 4, 1);
                }
            }
            const __m512 vscale = _mm512_set1_ps(scale);
            for (int64_t i = 0; i < (amx ? 16 : rows4); i++) { /* softmax over the keys row i sees, 16 at a time */
                bf16 *pi = p + i * width;
                float *si = s + i * width;
                const int64_t valid = i < rows ? start + t0 + i + 1 : 0;
                __m512 top = _mm512_set1_ps(MASKED), sum = _mm512_setzero_ps();
                for (int64_t k = 0; k < valid; k += 16) { /* the top raw score (scale > 0) */
                    const __mmask16 in = valid - k >= 16 ? 0xffff : (__mmask16)((1u << (valid - k)) - 1);
                    top = _mm512_mask_max_ps(top, in, top, _mm512_loadu_ps(si + k));
                }
                const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale);
                for (int64_t k = 0; k < valid; k += 16) {
                    const __mmask16 in = valid - k >= 16 ? 0xffff : (__mmask16)((1u << (valid - k)) - 1);
                    const __m512 e = exp16_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(si + k), vscale, max));
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
            float *c = b->c;
            for (int64_t c0 = 0; c0 < chunks16; c0 += 4) {
                const int64_t parts = chunks16 - c0 < 4 ? chunks16 - c0 : 4;
#if AMX
                if (amx) {
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
                    /* C tile j's row i at c + i * 64 + j * 16, as values_vector leaves it */
                    _tile_stored(0, c, 256);
                    _tile_stored(1, c + 16, 256);
                    _tile_stored(2, c + 32, 256);
                    _tile_stored(3, c + 48, 256);
                } else
#endif
                {
                    for (int64_t i = 0; i < rows4; i += 4) {
                        if (parts == 4)
                            values_vector(p + i * width, width, vv, chunks16, c0, used32 * 16, c + i * 64, 4, 4);
                        else
                            values_vector(p + i * width, width, vv, chunks16, c0, used32 * 16, c + i * 64, 4, 2);
                    }
                }
                for (int64_t j = 0; j < parts; j++)
                    for (int64_t i = 0; i < rows; i++)
                        store16(out + ((t0 + i) * heads + head) * dim + (c0 + j) * 16, _mm512_load_ps(c + i * 64 + j * 16));
            }
        }
}
#endif

/* Query rows per task of omniflow_chunk_attention_bf16: a chunk's rows split into slabs so
 * that every thread has several tasks (a slab lays out the keys it sees, a cost of one pass
 * over them, small beside its rows' attention over them). */
static int64_t slab_rows(int64_t chunk, int64_t tasks, int threads)
{
    int64_t slabs = (4 * threads + tasks - 1) / tasks;
    const int64_t most = (chunk + 127) / 128;
    if (slabs > most) slabs = most;
    if (slabs < 1) slabs = 1;
    return ((chunk + slabs - 1) / slabs + 15) / 16 * 16;
}

/* Causal attention of `count` chunks of `chunk` new tokens each, each chunk over its
 * sequence's context and itself (their K/V already in place), on AMX where `use_amx` and
 * the build allow, else on AVX-512 BF16: attend_chunk per (chunk, kv head, slab of query
 * rows) on the threads, the slabs that see the most keys first. Token t of chunk c, at
 * position start + t, attends keys 0..start + t. q: that token's head h at
 * q + (c * chunk + t) * q_row + h * dim; out: [count * chunk, heads, dim]. Key j of chunk c's
 * kv head h at
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
                                  int use_amx, int threads)
{
    if (!omniflow_context_attention_supported(heads, kv_heads, dim)) return -1;
#if VECTOR_ROWS
    const int64_t width = (start + chunk + 31) / 32 * 32, units = count * kv_heads;
    const int64_t slab = slab_rows(chunk, units, threads), slabs = (chunk + slab - 1) / slab;
    const int amx = AMX && use_amx;
#pragma omp parallel num_threads(threads)
    {
#if AMX
        amx_scratch tiles;
        if (amx) amx_begin(&tiles, 0);
#endif
        chunk_scratch buffers;
        chunk_begin(&buffers, width, dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < units * slabs; task++) {
            const int64_t s = slabs - 1 - task / units, c = task % units / kv_heads, h = task % kv_heads;
            const int64_t kv = c * kv_step + h * head_stride;
            const int64_t first = s * slab, last = first + slab < chunk ? first + slab : chunk;
            attend_chunk(q + c * chunk * q_row, q_row, keys + kv, values + kv, table, page_size,
                         page_stride, start, first, last, h, heads, heads / kv_heads, dim, scale,
                         out + c * chunk * heads * dim, &buffers, amx);
        }
        chunk_end(&buffers);
#if AMX
        if (amx) amx_end(&tiles);
#endif
    }
    return 0;
#else
    (void)q, (void)q_row, (void)keys, (void)values, (void)head_stride, (void)page_stride;
    (void)page_size, (void)table, (void)kv_step, (void)start, (void)chunk, (void)count;
    (void)scale, (void)out, (void)use_amx, (void)threads;
    return -1;
#endif
}
