/* Projections on AMX tiles. A weight [N, K] is re-laid once (omniflow/kernels/cpu.py,
 * pack_linear) as blocks of 32 output columns: block b, k-block kb (32 inputs) holds two
 * 16 x 16 x 2 tiles, half h's row kk, column n, pair p = W[column(b, h, n)][kb * 32 + 2 kk + p],
 * zero past N and K. Plain weights: column(b, h, n) = 32 b + 16 h + n. A fused gate/up weight
 * ([gate; up], `inter` rows each): half 0 is gate row 16 b + n, half 1 up row inter + 16 b + n,
 * so one block holds both halves of 16 columns of silu(gate) * up. Each block of 32 rows of x
 * is two A tiles, read in place for a decode step's 32 rows, else from a copy made once per
 * task (tile_rows); four C tiles accumulate in float32 and are rounded once, as a oneDNN bf16
 * GEMM does. */
#include "cpu_kernels.h"

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

void amx_begin(amx_scratch *scratch, int64_t tile_k)
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

void amx_end(amx_scratch *scratch)
{
    free(scratch->tiles);
    _tile_release();
}

/* How far ahead (in 2 KB k-blocks of weight tiles) a projection over few rows prefetches;
 * 16 measured no better than 8. */
#define PREFETCH_KBLOCKS 8

/* A decode step's 32 rows are read in place (a copy costs more than it saves there); more
 * rows, or rows off the 32 x 32 grid, as tiles (tile_rows). */
int reads_in_place(int64_t rows, int64_t K)
{
    return rows == 32 && K % 32 == 0;
}

/* omniflow_linear_bf16's blocks, shared out among the threads of the enclosing parallel
 * region, each with its amx_begin'd scratch (tiles for K inputs unless reads_in_place). */
void linear_body(const bf16 *x, int64_t lda, int64_t rows, int64_t K, const bf16 *packed,
                 int64_t N, int64_t inter, int silu, const bf16 *bias, bf16 *out, int64_t ldo,
                 amx_scratch *scratch)
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
