/* Projections on AVX-512 BF16 (vdpbf16ps), for CPUs without AMX: the same packed weights as
 * linear_amx.c (cpu.py, pack_linear). A packed row kk of a half is 16 columns x 2 inputs, the
 * pair layout vdpbf16ps takes, so one 512-bit load is 16 columns of one input pair and a
 * broadcast of x's pair multiplies all 16. A task holds GROUP_ROWS rows x one block of 32
 * columns in 2 x GROUP_ROWS float32 registers over all K, then rounds once through
 * store_block, as the AMX path does; rows past the last repeat the last row's reads and are
 * not stored. Larger row counts take CHUNK_ROWS rows a task, so a block's weights, read from
 * cache once per GROUP_ROWS rows, stay in L1/L2 while the chunk's groups use them. */
#include "cpu_kernels.h"

int omniflow_avx512_linear_supported(void)
{
#if VECTOR_ROWS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

#if VECTOR_ROWS
#define GROUP_ROWS 8
#define CHUNK_ROWS 64

/* x's inputs 2p, 2p + 1 of a row as one 32-bit lane pattern (the second zero past K). */
static inline __attribute__((always_inline)) __m512i pair_at(const bf16 *row, int64_t p, int64_t K)
{
    uint32_t v;
    if (2 * p + 1 < K)
        memcpy(&v, row + 2 * p, sizeof v);
    else
        v = row[2 * p];
    return _mm512_set1_epi32((int)v);
}

/* Rows m0 .. m0 + m - 1 (m <= GROUP_ROWS) x block b of 32 columns over all K into c
 * ([GROUP_ROWS rows][32], half h's columns at 16 h). */
static inline __attribute__((always_inline)) void group_block(const bf16 *x, int64_t lda, int64_t m0,
                                                              int64_t m, int64_t K, const bf16 *w,
                                                              float *c)
{
    __m512 acc[GROUP_ROWS][2];
    const bf16 *row[GROUP_ROWS];
    for (int r = 0; r < GROUP_ROWS; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        row[r] = x + (m0 + (r < m ? r : m - 1)) * lda;
    }
    const int64_t pairs = (K + 1) / 2, whole = K / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const bf16 *wp = w + (p >> 4) * 1024 + (p & 15) * 32;
        if ((p & 15) == 0) /* the k-block 4 ahead: 4 KB of weight lines for this block */
            for (int line = 0; line < 32; line++)
                _mm_prefetch((const char *)(wp + 4 * 1024 + line * 32), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 512);
        if (p < whole) {
#pragma GCC unroll 8
            for (int r = 0; r < GROUP_ROWS; r++) {
                uint32_t v;
                memcpy(&v, row[r] + 2 * p, sizeof v);
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)v);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            }
        } else {
            for (int r = 0; r < GROUP_ROWS; r++) {
                const __m512bh a = (__m512bh)pair_at(row[r], p, K);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            }
        }
    }
    for (int r = 0; r < GROUP_ROWS; r++) {
        _mm512_store_ps(c + r * 32, acc[r][0]);
        _mm512_store_ps(c + r * 32 + 16, acc[r][1]);
    }
}

/* omniflow_linear_avx512_bf16's tasks, shared out among the threads of the enclosing
 * parallel region (decode_layers.c runs it inside its own). */
void avx512_linear_body(const bf16 *x, int64_t lda, int64_t rows, int64_t K, const bf16 *packed,
                        int64_t N, int64_t inter, int silu, const bf16 *bias, bf16 *out,
                        int64_t ldo)
{
    const int64_t kblocks = (K + 31) / 32;
    const int64_t blocks = inter > 0 ? (inter + 15) / 16 : (N + 31) / 32;
    const int64_t chunk = rows <= CHUNK_ROWS ? GROUP_ROWS : CHUNK_ROWS;
    const int64_t tasks = (rows + chunk - 1) / chunk;
    float c[GROUP_ROWS * 32] __attribute__((aligned(64)));
#pragma omp for collapse(2) schedule(dynamic, 2)
    for (int64_t task = 0; task < tasks; task++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t last = (task + 1) * chunk < rows ? (task + 1) * chunk : rows;
            for (int64_t m0 = task * chunk; m0 < last; m0 += GROUP_ROWS) {
                const int64_t m = last - m0 < GROUP_ROWS ? last - m0 : GROUP_ROWS;
                group_block(x, lda, m0, m, K, packed + b * kblocks * 1024, c);
                store_block(c, m, m0, b, N, inter, silu, bias, out, ldo);
            }
        }
}
#endif

/* omniflow_linear_bf16 (linear_amx.c) on AVX-512 BF16: same arguments, same packed weights.
 * Returns -1, doing nothing, where this build has no AVX-512 BF16. */
int omniflow_linear_avx512_bf16(const bf16 *x, int64_t lda, int64_t rows, int64_t K,
                                const bf16 *packed, int64_t N, int64_t inter, int silu,
                                const bf16 *bias, bf16 *out, int64_t ldo, int threads)
{
#if VECTOR_ROWS
#pragma omp parallel num_threads(threads)
    avx512_linear_body(x, lda, rows, K, packed, N, inter, silu, bias, out, ldo);
    return 0;
#else
    (void)x, (void)lda, (void)rows, (void)K, (void)packed, (void)N, (void)inter, (void)silu;
    (void)bias, (void)out, (void)ldo, (void)threads;
    return -1;
#endif
}
