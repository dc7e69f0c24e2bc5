/* One decoder step's attention over an int8 cache, as plain loops over rows and heads: what
 * onnxruntime's GroupQueryAttention computes at the step graph's shapes (one query position per
 * row, per-tensor cache scales), for bench.attention_kernel to time beside it.
 *
 * q, k_new, v_new: (rows, heads * head_dim) float; cache_k, cache_v: (rows, heads, capacity,
 * head_dim) int8; past[r]: row r's cached positions. The new key and value are quantized
 * (round to nearest, saturated) into column past[r] of the cache, then row r attends over its
 * past[r] + 1 columns: out = softmax(q k^T / sqrt(head_dim)) v, written as (rows, heads * head_dim).
 * scratch holds capacity floats; head_dim is at most 256.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static int8_t quantize(float x, float inverse_scale) {
    float q = nearbyintf(x * inverse_scale);
    return (int8_t)(q > 127.f ? 127.f : (q < -128.f ? -128.f : q));
}

/* One row and head: its new key and value into column `at_column`, then its attention over
 * `length` columns into o. Inlined with head_dim a constant where it is 64 (the accumulators
 * then stay in registers). */
static inline void attend(const float *restrict query, const float *restrict k_new, const float *restrict v_new,
                          int8_t *restrict keys, int8_t *restrict values, int at_column, int length, int head_dim,
                          float score_scale, float key_scale, float value_scale, float *restrict o,
                          float *restrict scratch) {
    for (int d = 0; d < head_dim; d++) {
        keys[(size_t)at_column * head_dim + d] = quantize(k_new[d], 1.f / key_scale);
        values[(size_t)at_column * head_dim + d] = quantize(v_new[d], 1.f / value_scale);
    }
    float top = -INFINITY;
    for (int l = 0; l < length; l++) {
        const int8_t *key = keys + (size_t)l * head_dim;
        float dot = 0.f;
        for (int d = 0; d < head_dim; d++) dot += query[d] * (float)key[d];
        scratch[l] = dot * score_scale;
        top = scratch[l] > top ? scratch[l] : top;
    }
    float total = 0.f;
    for (int l = 0; l < length; l++) {
        scratch[l] = expf(scratch[l] - top);
        total += scratch[l];
    }
    float sum[256] = {0};
    for (int l = 0; l < length; l++) {
        const int8_t *value = values + (size_t)l * head_dim;
        const float p = scratch[l];
        for (int d = 0; d < head_dim; d++) sum[d] += p * (float)value[d];
    }
    const float norm = value_scale / total;
    for (int d = 0; d < head_dim; d++) o[d] = sum[d] * norm;
}

void attention_step(const float *q, const float *k_new, const float *v_new, int8_t *cache_k, int8_t *cache_v,
                    const int32_t *past, int rows, int heads, int capacity, int head_dim, float key_scale,
                    float value_scale, float *out, float *scratch) {
    const float score_scale = key_scale / sqrtf((float)head_dim);
    const int width = heads * head_dim;
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < heads; h++) {
            const size_t slot = ((size_t)r * heads + h) * capacity * head_dim;
            const size_t at = (size_t)r * width + (size_t)h * head_dim;
            if (head_dim == 64)
                attend(q + at, k_new + at, v_new + at, cache_k + slot, cache_v + slot, past[r], past[r] + 1, 64,
                       score_scale, key_scale, value_scale, out + at, scratch);
            else
                attend(q + at, k_new + at, v_new + at, cache_k + slot, cache_v + slot, past[r], past[r] + 1, head_dim,
                       score_scale, key_scale, value_scale, out + at, scratch);
        }
    }
}
