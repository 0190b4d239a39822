/* A decode step's decoder layers in one call: the other files' row and task bodies inside
 * one parallel region. */
#include "cpu_kernels.h"

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
 * rows x (2 hidden + (heads + 2 kv_heads) dim + heads dim + inter). amx: the projections on
 * AMX (linear_amx.c), else on AVX-512 BF16 (linear_avx512.c). Returns -1, doing nothing,
 * where that path or decode attention for these heads is not in this build. */
int omniflow_decode_layers_bf16(bf16 *x, int64_t rows, int64_t layers, const int64_t *layer,
                                int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t inter, float eps, float scale, int64_t head_stride,
                                int64_t page_stride, int64_t page_size, const bf16 *cos,
                                const bf16 *sin, const int64_t *slots, const int64_t *tables,
                                int64_t table_width, const int64_t *lengths, bf16 *scratch,
                                int amx, int threads)
{
    const int64_t group = heads / kv_heads;
    if (!omniflow_decode_attention_supported(group, dim) || group * kv_heads != heads) return -1;
    if (amx && !AMX) return -1;
#if VECTOR_ROWS
    const int64_t q_size = heads * dim, qkv_size = (heads + 2 * kv_heads) * dim;
    bf16 *h = scratch, *qkv = h + rows * hidden, *attended = qkv + rows * qkv_size;
    bf16 *gated = attended + rows * q_size, *delta = gated + rows * inter;
    int64_t widest = 1, tile_k = 0;
    for (int64_t r = 0; r < rows; r++)
        if (lengths[r] > widest) widest = lengths[r];
    const int64_t inputs[3] = {hidden, q_size, inter};
#if AMX
    for (int i = 0; i < 3; i++)
        if (!reads_in_place(rows, inputs[i]) && inputs[i] > tile_k) tile_k = inputs[i];
#define PROJECT(...) (amx ? linear_body(__VA_ARGS__, &tiles) : avx512_linear_body(__VA_ARGS__))
#else
    (void)inputs, (void)tile_k;
#define PROJECT(...) avx512_linear_body(__VA_ARGS__)
#endif
#define AT(field) ((bf16 *)(intptr_t)w[field])
#pragma omp parallel num_threads(threads)
    {
#if AMX
        amx_scratch tiles;
        if (amx) amx_begin(&tiles, tile_k);
#endif
        float *scores = attention_scores(group, widest);
        for (int64_t l = 0; l < layers; l++) {
            const int64_t *w = layer + l * L_FIELDS;
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; r++)
                norm_row(x, l ? delta : NULL, AT(L_NORM), h, r, hidden, eps);
            PROJECT(h, hidden, rows, hidden, AT(L_QKV), qkv_size, 0, 0, AT(L_QKV_BIAS), qkv,
                        qkv_size);
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; r++) {
                rotary_row(qkv, qkv_size, r, heads + kv_heads, dim, cos, sin);
                kv_write_row(qkv + q_size, qkv + q_size + kv_heads * dim, qkv_size, r, kv_heads,
                             dim, AT(L_KEYS), AT(L_VALUES), head_stride, slots);
            }
            attention_body(qkv, qkv_size, AT(L_KEYS), AT(L_VALUES), head_stride, page_stride,
                           page_size, tables, table_width, lengths, rows, heads, kv_heads, dim,
                           scale, attended, scores);
            PROJECT(attended, q_size, rows, q_size, AT(L_O), hidden, 0, 0, AT(L_O_BIAS), delta,
                        hidden);
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; r++)
                norm_row(x, delta, AT(L_POST_NORM), h, r, hidden, eps);
            PROJECT(h, hidden, rows, hidden, AT(L_GATE_UP), 2 * inter, inter, 1,
                        AT(L_GATE_UP_BIAS), gated, inter);
            PROJECT(gated, inter, rows, inter, AT(L_DOWN), hidden, 0, 0, AT(L_DOWN_BIAS), delta,
                        hidden);
        }
#pragma omp for schedule(dynamic, 8)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hidden; i++)
                x[r * hidden + i] = f2bf(bf2f(x[r * hidden + i]) + bf2f(delta[r * hidden + i]));
        free(scores);
#if AMX
        if (amx) amx_end(&tiles);
#endif
    }
#undef AT
#undef PROJECT
    return 0;
#else
    (void)x, (void)rows, (void)layers, (void)layer, (void)hidden, (void)inter, (void)eps;
    (void)scale, (void)head_stride, (void)page_stride, (void)page_size, (void)cos, (void)sin;
    (void)slots, (void)tables, (void)table_width, (void)lengths, (void)scratch, (void)amx;
    (void)threads;
    return -1;
#endif
}
