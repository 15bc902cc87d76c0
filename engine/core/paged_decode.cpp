// Decode attention over the paged KV cache, read in place (issue 18).
//
// The torch path gathers every decode's KV history into a fresh tensor (index_select) and
// then runs SDPA over the copy: the history is read twice and written once per layer and
// step. This kernel walks each request's block table and reads each cached key and value
// once, as vLLM's CPU and CUDA paged-attention kernels do. Plain C ABI, loaded with ctypes:
// no torch headers, so it builds in about a second with the system compiler.
//
// Layout (engine/core/attention.py::cache_shape, torch path): one layer's cache is
// [kv_heads, blocks, block_size, head_dim], contiguous. Query head h reads KV head h / group.
// Scores are kept per (request, KV head) in a scratch row, softmaxed in float, then the
// values are summed with those weights: two passes over the keys' blocks, none copied.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t PREFETCH_BLOCKS = 1;  // how far ahead to fetch (1, 2 and 4 measured alike)

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {  // bfloat16: the high half of a float
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

inline void store(float* p, int64_t i, float value) { p[i] = value; }

inline void store(uint16_t* p, int64_t i, float value) {  // round to nearest even, as torch
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    if (std::isnan(value)) {
        p[i] = 0x7fc0;
        return;
    }
    bits += 0x7fff + ((bits >> 16) & 1);
    p[i] = static_cast<uint16_t>(bits >> 16);
}

// A request's blocks sit anywhere in the pool, where the hardware prefetcher cannot follow
// (it stops at page boundaries): while one key row is computed, fetch the same row of the
// block `distance` ahead, or every block starts with a stall on memory (a plain walk read
// the blocks at half the bandwidth of a copy here).
template <typename T>
inline void prefetch_ahead(const T* head, const int64_t* table, int64_t pos, int64_t length,
                           int64_t block_size, int64_t head_dim, int64_t distance) {
    const int64_t ahead = pos + distance * block_size;
    if (ahead >= length) return;
    const char* row = reinterpret_cast<const char*>(
        head + (table[ahead / block_size] * block_size + ahead % block_size) * head_dim);
    for (int64_t line = 0; line < head_dim * static_cast<int64_t>(sizeof(T)); line += 64)
        __builtin_prefetch(row + line);
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* tables,
            const int64_t* lengths, int64_t batch, int64_t table_width, int64_t kv_heads,
            int64_t group, int64_t head_dim, int64_t num_blocks, int64_t block_size,
            float scale, int64_t window, float softcap, int threads) {
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const int64_t q_heads = kv_heads * group;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> scores, query, acc;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * kv_heads; ++task) {
            const int64_t b = task / kv_heads, kh = task % kv_heads;
            const int64_t length = lengths[b];
            const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
            const int64_t keys = length - first;
            scores.resize(group * keys);
            query.resize(group * head_dim);
            acc.assign(group * head_dim, 0.0f);
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < head_dim; ++d)
                    query[g * head_dim + d] = load(q, (b * q_heads + kh * group + g) * head_dim + d);
            const int64_t* table = tables + b * table_width;
            const T* k_head = k_cache + kh * head_stride;
            const T* v_head = v_cache + kh * head_stride;
            for (int64_t pos = first; pos < length;) {  // block by block: no division per key
                const int64_t offset = pos % block_size;
                const int64_t span = std::min(block_size - offset, length - pos);
                const int64_t base = (table[pos / block_size] * block_size + offset) * head_dim;
                for (int64_t t = 0; t < span; ++t) {
                    prefetch_ahead(k_head, table, pos + t, length, block_size, head_dim, PREFETCH_BLOCKS);
                    const T* key = k_head + base + t * head_dim;
                    for (int64_t g = 0; g < group; ++g) {
                        const float* qg = query.data() + g * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(key, d);
                        float s = dot * scale;
                        if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
                        scores[g * keys + pos - first + t] = s;
                    }
                }
                pos += span;
            }
            for (int64_t g = 0; g < group; ++g) {
                float* sg = scores.data() + g * keys;
                float top = sg[0];
#pragma omp simd reduction(max : top)
                for (int64_t i = 0; i < keys; ++i) top = std::max(top, sg[i]);
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < keys; ++i) {
                    sg[i] = std::exp(sg[i] - top);
                    total += sg[i];
                }
                const float inv = 1.0f / total;
#pragma omp simd
                for (int64_t i = 0; i < keys; ++i) sg[i] *= inv;
            }
            for (int64_t pos = first; pos < length;) {
                const int64_t offset = pos % block_size;
                const int64_t span = std::min(block_size - offset, length - pos);
                const int64_t base = (table[pos / block_size] * block_size + offset) * head_dim;
                for (int64_t t = 0; t < span; ++t) {
                    prefetch_ahead(v_head, table, pos + t, length, block_size, head_dim, PREFETCH_BLOCKS);
                    const T* value = v_head + base + t * head_dim;
                    for (int64_t g = 0; g < group; ++g) {
                        const float w = scores[g * keys + pos - first + t];
                        float* ag = acc.data() + g * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) ag[d] += w * load(value, d);
                    }
                }
                pos += span;
            }
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < head_dim; ++d)
                    store(out, (b * q_heads + kh * group + g) * head_dim + d, acc[g * head_dim + d]);
        }
    }
}

}  // namespace

extern "C" {

// q, out: [batch, kv_heads * group, head_dim]; caches: [kv_heads, num_blocks, block_size,
// head_dim]; tables: [batch, table_width] block ids; lengths: [batch] keys per request
// (its position + 1). window > 0 keeps the last `window` keys; softcap > 0 caps scores.
// bf16 != 0: every tensor is bfloat16 (accumulation stays float), else float32.
void paged_decode(const void* q, const void* k_cache, const void* v_cache, void* out,
                  const int64_t* tables, const int64_t* lengths, int64_t batch,
                  int64_t table_width, int64_t kv_heads, int64_t group, int64_t head_dim,
                  int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                  float softcap, int bf16, int threads) {
    if (bf16)
        attend(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
               static_cast<const uint16_t*>(v_cache), static_cast<uint16_t*>(out), tables,
               lengths, batch, table_width, kv_heads, group, head_dim, num_blocks, block_size,
               scale, window, softcap, threads);
    else
        attend(static_cast<const float*>(q), static_cast<const float*>(k_cache),
               static_cast<const float*>(v_cache), static_cast<float*>(out), tables, lengths,
               batch, table_width, kv_heads, group, head_dim, num_blocks, block_size, scale,
               window, softcap, threads);
}

}  // extern "C"
