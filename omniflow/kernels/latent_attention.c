/* MLA's decode attention over latent pages (DeepSeek-V2, LongCat-Flash), read in place.
 *
 * In the absorbed form every query head scores against one shared latent per token,
 * [latent ‖ rotary key] (`width` values), and the output is the probability-weighted latent's
 * first `rank` values. The engine stores a token's latent split in two: its first `half`
 * values in the cache's key pages, the rest in its value pages (engine/latent_attention.py).
 *
 * Plain C that the compiler vectorizes for the machine it is built on (-march=native), so it
 * runs on every x86-64 CPU the library builds for, AVX-512 or not. Per (row, group of heads):
 * the context in blocks of LATENT_BLOCK tokens, each block's latents widened to float32 once
 * and shared by every head of the group, softmax online (running max and sum per head),
 * everything in float32, rounded to bf16 once at the end.
 */
#include "cpu_kernels.h"

#define LATENT_BLOCK 64

static inline void widen(const bf16 *restrict src, float *restrict dst, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf2f(src[i]);
}

static void *scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Heads [h0, h0 + g) of row r: q [g, width] float32, the context's n tokens through `table`. */
static void attend_latent(const float *restrict qf, int64_t g, int64_t width, int64_t rank,
                          const bf16 *firsts, const bf16 *seconds, int64_t half,
                          int64_t page_size, const int64_t *table, int64_t n, float scale,
                          float *restrict latents, float *restrict acc, float *restrict best,
                          float *restrict total, bf16 *out, int64_t out_head)
{
    const int64_t page_stride = page_size * half;
    float s[LATENT_BLOCK];
    for (int64_t h = 0; h < g; h++) {
        best[h] = MASKED;
        total[h] = 0.0f;
        memset(acc + h * rank, 0, sizeof(float) * (size_t)rank);
    }
    for (int64_t t0 = 0; t0 < n; t0 += LATENT_BLOCK) {
        const int64_t b = n - t0 < LATENT_BLOCK ? n - t0 : LATENT_BLOCK;
        for (int64_t j = 0; j < b; j++) {
            const int64_t t = t0 + j;
            const int64_t at = table[t / page_size] * page_stride + (t % page_size) * half;
            widen(firsts + at, latents + j * width, half);
            widen(seconds + at, latents + j * width + half, width - half);
        }
        for (int64_t h = 0; h < g; h++) {
            const float *qh = qf + h * width;
            float top = best[h];
            for (int64_t j = 0; j < b; j++) {
                const float *c = latents + j * width;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < width; i++) dot += qh[i] * c[i];
                s[j] = dot * scale;
                if (s[j] > top) top = s[j];
            }
            const float fix = expf(best[h] - top);
            float *a = acc + h * rank, sum = total[h] * fix;
#pragma omp simd
            for (int64_t i = 0; i < rank; i++) a[i] *= fix;
            for (int64_t j = 0; j < b; j++) {
                const float p = expf(s[j] - top), *c = latents + j * width;
                sum += p;
#pragma omp simd
                for (int64_t i = 0; i < rank; i++) a[i] += p * c[i];
            }
            best[h] = top;
            total[h] = sum;
        }
    }
    for (int64_t h = 0; h < g; h++) {
        const float inv = 1.0f / total[h];
        for (int64_t i = 0; i < rank; i++) out[h * out_head + i] = f2bf(acc[h * rank + i] * inv);
    }
}

/* q: [rows, heads, width] bf16, row r at q + r * q_row (heads contiguous);
 * firsts/seconds: one layer's latent halves, token o of page p at base + (p * page_size + o) *
 * half (the second holds width - half values of each such slot);
 * tables: [rows, table_width] page ids; lengths: [rows] context tokens (>= 1);
 * out: [rows, heads, rank] bf16. Returns -1, doing nothing, for a shape it cannot serve. */
int omniflow_latent_decode_attention_bf16(const bf16 *q, int64_t q_row, int64_t heads,
                                          int64_t width, int64_t rank, const bf16 *firsts,
                                          const bf16 *seconds, int64_t half, int64_t page_size,
                                          const int64_t *tables, int64_t table_width,
                                          const int64_t *lengths, int64_t rows, float scale,
                                          bf16 *out, int threads)
{
    if (heads < 1 || half < 1 || width - half > half || width - half < 0 || rank < 1 ||
        rank > width || page_size < 1 || threads < 1)
        return -1;
    /* Few rows: each row's heads split among the threads (each widens the row's latents). */
    int64_t split = rows >= threads ? 1 : (threads + rows - 1) / rows;
    if (split > heads) split = heads;
    const int64_t per = (heads + split - 1) / split;
#pragma omp parallel num_threads(threads)
    {
        float *latents = scratch(sizeof(float) * LATENT_BLOCK * (size_t)width);
        float *qf = scratch(sizeof(float) * (size_t)(per * width));
        float *acc = scratch(sizeof(float) * (size_t)(per * rank));
        float *best = scratch(sizeof(float) * (size_t)per);
        float *total = scratch(sizeof(float) * (size_t)per);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * split; task++) {
            const int64_t r = task / split, h0 = (task % split) * per;
            const int64_t g = h0 + per > heads ? heads - h0 : per;
            if (g <= 0) continue;
            for (int64_t h = 0; h < g; h++)
                widen(q + r * q_row + (h0 + h) * width, qf + h * width, width);
            attend_latent(qf, g, width, rank, firsts, seconds, half, page_size,
                          tables + r * table_width, lengths[r], scale, latents, acc, best, total,
                          out + (r * heads + h0) * rank, rank);
        }
        free(latents);
        free(qf);
        free(acc);
        free(best);
        free(total);
    }
    return 0;
}
