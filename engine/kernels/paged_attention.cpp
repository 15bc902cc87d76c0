// Attention over the paged KV cache, read in place as vLLM's paged-attention kernels read it:
// every decode of a step in one call (paged_decode), one prefill chunk per call
// (paged_prefill). Each request's block table is walked and each cached key and value read
// once, where the torch path gathers the history into a copy first.
//
// Layout (attention.py's cache_shape): one layer's cache is [kv_heads, blocks, block_size,
// head_dim], contiguous; query head h reads KV head h / group. Scores are kept per (request,
// KV head) in a scratch row and softmaxed in float; a second pass sums the values.

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vectors.h"

namespace {

using namespace tokenflow;

// A request's blocks sit anywhere in the pool, where the hardware prefetcher cannot follow:
// the block AHEAD is prefetched, one row per 4 KiB page, which starts the L2 streamer.
constexpr int64_t PAGE_BYTES = 4096;

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t line = 0; line < head_dim * static_cast<int64_t>(sizeof(T)); line += 64)
        __builtin_prefetch(bytes + line, 0, 2);  // to L2: its miss queue is deeper than L1's
}

// The row at `at` elements into `head`, and into `companion` if there is one.
template <typename T>
inline void fetch_pair(const T* head, const T* companion, int64_t at, int64_t head_dim) {
    prefetch_row(head + at, head_dim);
    if (companion != nullptr) prefetch_row(companion + at, head_dim);
}

// Two blocks ahead: one block's compute is about one memory latency, so at one block ahead
// the next block's last rows arrive late.
constexpr int64_t AHEAD = 2;

// Whether row t of a block starts a page (blocks start on one where their size is a
// multiple of PAGE_BYTES; else every row that crosses into a new page, near enough).
inline bool starts_page(int64_t t, int64_t row_bytes) {
    return t * row_bytes % PAGE_BYTES < row_bytes;
}

// Calls visit(row, index) for the cached rows of positions [first, length) of one head, in
// order, block by block (no division per key), prefetching AHEAD blocks ahead. `companion`,
// another cache's slice laid out like `head` (the values beside the keys), is prefetched at
// the same places, so that a later walk over it reads from L2.
template <typename T, typename Visit>
inline void walk(const T* head, const int64_t* table, int64_t first, int64_t length,
                 int64_t block_size, int64_t head_dim, Visit visit,
                 const T* companion = nullptr) {
    const int64_t row_stride = head_dim, block_stride = block_size * head_dim;
    const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
    const int64_t last_block = (length - 1) / block_size;
    const int64_t first_block = first / block_size;
    for (int64_t block = first_block + 1; block < first_block + AHEAD && block <= last_block;
         ++block)
        for (int64_t t = 0; t < block_size; ++t)
            if (starts_page(t, row_bytes))
                fetch_pair(head, companion, table[block] * block_stride + t * row_stride,
                           head_dim);
    for (int64_t pos = first; pos < length;) {
        const int64_t block = pos / block_size, offset = pos % block_size;
        const int64_t span = std::min(block_size - offset, length - pos);
        const T* rows = head + table[block] * block_stride + offset * row_stride;
        // where the block AHEAD places on starts, in elements; -1 past the last block
        const int64_t ahead = block + AHEAD <= last_block ? table[block + AHEAD] * block_stride
                                                          : -1;
        for (int64_t t = 0; t < span; ++t) {
            if (ahead >= 0 && starts_page(offset + t, row_bytes))
                fetch_pair(head, companion, ahead + (offset + t) * row_stride, head_dim);
            visit(rows + t * row_stride, pos - first + t);
        }
        if (ahead >= 0)  // a first block entered mid-way: the rest of its successor
            for (int64_t t = 0; t < offset; ++t)
                if (starts_page(t, row_bytes))
                    fetch_pair(head, companion, ahead + t * row_stride, head_dim);
        pos += span;
    }
}

// HeadDim > 0 fixes the head size at compile time (the common 64 and 128): the loops over it
// unroll and a head's accumulator stays in registers.
template <typename T, int64_t HeadDim>
void attend(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, T* out,
            const int64_t* tables, const int64_t* lengths, int64_t batch, int64_t table_width,
            int64_t kv_heads, int64_t group, int64_t runtime_head_dim, int64_t num_blocks,
            int64_t block_size,
            float scale, int64_t window, float softcap, int threads) {
    const int64_t head_dim = HeadDim > 0 ? HeadDim : runtime_head_dim;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const int64_t q_heads = kv_heads * group;
    const bool capped = softcap > 0.0f;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> score_buffer, query_buffer, acc_buffer;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * kv_heads; ++task) {
            const int64_t b = task / kv_heads, kh = task % kv_heads;
            const int64_t length = lengths[b];
            const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
            const int64_t keys = length - first;
            score_buffer.resize(group * keys);
            query_buffer.resize(group * head_dim);
            acc_buffer.assign(group * head_dim, 0.0f);
            float* __restrict scores = score_buffer.data();
            float* __restrict query = query_buffer.data();
            float* __restrict acc = acc_buffer.data();
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < head_dim; ++d)
                    query[g * head_dim + d] =
                        load(q, b * q_stride + (kh * group + g) * head_dim + d);
            const int64_t* table = tables + b * table_width;
            walk(k_cache + kh * head_stride, table, first, length, block_size, head_dim,
                 [&](const T* __restrict key, int64_t i) {
                     for (int64_t g = 0; g < group; ++g) {
                         const float* __restrict qg = query + g * head_dim;
                         float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                         for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(key, d);
                         float s = dot * scale;
                         if (capped) s = softcap * std::tanh(s / softcap);
                         scores[g * keys + i] = s;
                     }
                 },
                 v_cache + kh * head_stride);  // the values, for the pass below
            for (int64_t g = 0; g < group; ++g) {
                float* __restrict sg = scores + g * keys;
                float top = sg[0];
#pragma omp simd reduction(max : top)
                for (int64_t i = 0; i < keys; ++i) top = std::max(top, sg[i]);
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < keys; ++i) {
                    sg[i] = expf(sg[i] - top);  // C expf: glibc has a vector form (libmvec)
                    total += sg[i];
                }
                const float inv = 1.0f / total;
#pragma omp simd
                for (int64_t i = 0; i < keys; ++i) sg[i] *= inv;
            }
            // two query heads per walk over the values: each value row is loaded once for both
            for (int64_t g = 0; g < group; g += 2) {
                const float* __restrict s0 = scores + g * keys;
                float* a0 = acc + g * head_dim;
                auto accumulate = [&](auto pair, float* __restrict sum0, float* __restrict sum1) {
                    walk(v_cache + kh * head_stride, table, first, length, block_size, head_dim,
                         [&](const T* __restrict value, int64_t i) {
                             const float w0 = s0[i];
                             if constexpr (decltype(pair)::value) {
                                 const float w1 = s0[keys + i];
#pragma omp simd
                                 for (int64_t d = 0; d < head_dim; ++d) {
                                     const float x = load(value, d);
                                     sum0[d] += w0 * x;
                                     sum1[d] += w1 * x;
                                 }
                             } else {
#pragma omp simd
                                 for (int64_t d = 0; d < head_dim; ++d)
                                     sum0[d] += w0 * load(value, d);
                             }
                         });
                };
                const bool pair = g + 1 < group;
                if constexpr (HeadDim > 0) {  // locals of fixed size can live in registers
                    float local[2][HeadDim] = {};
                    if (pair) accumulate(std::true_type{}, local[0], local[1]);
                    else accumulate(std::false_type{}, local[0], nullptr);
                    std::memcpy(a0, local, (pair ? 2 : 1) * sizeof local[0]);
                } else if (pair) {
                    accumulate(std::true_type{}, a0, a0 + head_dim);
                } else {
                    accumulate(std::false_type{}, a0, nullptr);
                }
            }
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < head_dim; ++d)
                    store(out, (b * q_heads + kh * group + g) * head_dim + d, acc[g * head_dim + d]);
        }
    }
}

// ---- prefill: one chunk's queries over its request's history and itself -------------------
//
// Flash-style: an online softmax over tiles of keys, so no score matrix larger than a tile
// exists. A block of LANES query rows is one vector per head dimension (queries transposed
// once), so each cached key row is read in place and broadcast one element at a time: a
// tile's scores are [key][LANES rows], and the softmax's max, exp and sums run across keys
// vector by vector, with no per-row reductions. P·V builds the output the same way,
// [head dim][LANES rows].

// LANES (cpu_vectors.h): query rows per block, and keys per score tile
constexpr int TILE_KEYS = 64;   // keys per softmax step: four score tiles
constexpr int MAX_HEAD_DIM = 256;
constexpr float MASKED = -1e30f;  // finite: the library is built with -ffast-math
constexpr float EXP_FLOOR = -87.0f;  // expf above its underflow, which glibc's vector form
                                     // hands to a slow scalar path

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

inline vec vexp(vec x) {  // one call of glibc's vector expf (-ffast-math vectorises the loop)
    alignas(64) float lanes[LANES];
    vstore(lanes, x);
    for (int i = 0; i < LANES; ++i) lanes[i] = expf(lanes[i]);
    return vload(lanes);
}

// LANES cached rows [key, key + LANES) of one head as float, in place when the cache is float and
// its blocks hold whole tiles, else copied into `buffer` (rows at or past `length`: zeros).
template <typename T>
inline const float* tile_rows(const T* head, const int64_t* table, int64_t key, int64_t length,
                              int64_t block_size, int64_t head_dim, float* buffer) {
    auto cached = [&](int64_t pos) {  // position pos's row in its block
        return head + (table[pos / block_size] * block_size + pos % block_size) * head_dim;
    };
    if constexpr (std::is_same_v<T, float>)
        if (block_size % LANES == 0) return cached(key);
    for (int k = 0; k < LANES; ++k) {
        float* row = buffer + k * head_dim;
        if (key + k >= length) {
            std::fill(row, row + head_dim, 0.0f);
            continue;
        }
        const T* source = cached(key + k);
        for (int64_t d = 0; d < head_dim; ++d) row[d] = load(source, d);
    }
    return buffer;
}

// Query rows [row0, row0 + rows) of heads [h0, h0 + G), which share one KV head, at
// positions start + row; HeadDim > 0 fixes the head size at compile time (the score tile's
// row offsets become constants). G = 2 loads each key and value element once for both heads
// (a GQA group's heads read the same cache), where one head at a time loaded it per multiply.
template <typename T, int64_t HeadDim, int G>
void prefill_rows(const T* q, const T* k_head, const T* v_head, T* out, const int64_t* table,
                  int64_t h0, int64_t q_heads, int64_t row0, int rows, int64_t start,
                  int64_t length, int64_t runtime_head_dim, int64_t block_size, float scale,
                  int64_t window, float softcap) {
    constexpr int STEP = LANES / G;  // keys (scores) or head dims (output) one pass holds
    const int64_t head_dim = HeadDim > 0 ? HeadDim : runtime_head_dim;
    alignas(64) float query[G][MAX_HEAD_DIM][LANES];  // transposed, scaled; padding rows zero
    alignas(64) float acc[G][MAX_HEAD_DIM][LANES];  // the output, unnormalised
    alignas(64) float scores[G][TILE_KEYS][LANES];
    alignas(64) float key_buffer[TILE_KEYS / LANES][LANES * MAX_HEAD_DIM];
    alignas(64) float value_buffer[TILE_KEYS / LANES][LANES * MAX_HEAD_DIM];
    for (int g = 0; g < G; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
            for (int r = 0; r < LANES; ++r) {
                query[g][d][r] = r < rows
                    ? load(q, ((row0 + r) * q_heads + h0 + g) * head_dim + d) * scale : 0.0f;
                acc[g][d][r] = 0.0f;
            }
    const int64_t first_pos = start + row0, last_pos = first_pos + rows - 1;
    ivec positions;
    for (int r = 0; r < LANES; ++r) positions[r] = static_cast<int32_t>(first_pos + r);
    vec top[G], total[G];
    for (int g = 0; g < G; ++g) top[g] = splat(MASKED), total[g] = splat(0.0f);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / LANES * LANES : 0;
    const int64_t hi = last_pos + 1;
    for (int64_t t0 = lo; t0 < hi; t0 += TILE_KEYS) {
        const int tiles = static_cast<int>((std::min<int64_t>(TILE_KEYS, hi - t0) + LANES - 1) / LANES);
        const int keys = tiles * LANES;
        const float* values[TILE_KEYS / LANES];
        for (int u = 0; u < tiles; ++u) {  // scores [key][row] = Σ_d key[d] · query[d][row]
            const int64_t key0 = t0 + u * LANES;
            const float* rows_k = tile_rows(k_head, table, key0, length, block_size, head_dim,
                                            key_buffer[u]);
            values[u] = tile_rows(v_head, table, key0, length, block_size, head_dim,
                                  value_buffer[u]);
            for (int k0 = 0; k0 < LANES; k0 += STEP) {
                vec s[G][STEP] = {};
                for (int64_t d = 0; d < head_dim; ++d) {
                    vec qd[G];
                    for (int g = 0; g < G; ++g) qd[g] = vload(query[g][d]);
                    for (int k = 0; k < STEP; ++k) {
                        const vec key = splat(rows_k[(k0 + k) * head_dim + d]);
                        for (int g = 0; g < G; ++g) s[g][k] += key * qd[g];
                    }
                }
                for (int g = 0; g < G; ++g)
                    for (int k = 0; k < STEP; ++k) vstore(scores[g][u * LANES + k0 + k], s[g][k]);
            }
        }
        // every row sees every key of the tile: none after the first row, none out of a window
        const bool whole = t0 + keys - 1 <= first_pos && (window <= 0 || t0 > last_pos - window);
        for (int g = 0; g < G; ++g) {
            vec next = top[g];
            for (int j = 0; j < keys; ++j) {
                vec s = vload(scores[g][j]);
                if (softcap > 0.0f) {
                    alignas(64) float lanes[LANES];
                    vstore(lanes, s / softcap);
                    for (int i = 0; i < LANES; ++i) lanes[i] = std::tanh(lanes[i]);
                    s = vload(lanes) * softcap;
                }
                if (!whole) {
                    const int32_t key = static_cast<int32_t>(t0 + j);
                    ivec seen = positions >= key;
                    if (window > 0) seen &= positions - key < static_cast<int32_t>(window);
                    s = seen ? s : splat(MASKED);
                }
                vstore(scores[g][j], s);
                next = vmax(next, s);
            }
            const vec rescale = top[g] > MASKED ? vexp(vmax(top[g] - next, splat(EXP_FLOOR)))
                                                : splat(0.0f);
            vec added = splat(0.0f);
            for (int j = 0; j < keys; ++j) {
                const vec s = vload(scores[g][j]);
                vec p = vexp(vmax(s - next, splat(EXP_FLOOR)));
                if (!whole) p = s > MASKED ? p : splat(0.0f);
                vstore(scores[g][j], p);
                added += p;
            }
            total[g] = total[g] * rescale + added;
            bool moved = false;
            for (int r = 0; r < LANES; ++r) moved |= next[r] != top[g][r];
            if (moved)
                for (int64_t d = 0; d < head_dim; ++d)
                    vstore(acc[g][d], vload(acc[g][d]) * rescale);
            top[g] = next;
        }
        // acc[d][row] += Σ_key value[d] · p
        for (int64_t d0 = 0; d0 < head_dim; d0 += STEP) {
            vec o[G][STEP];
            for (int g = 0; g < G; ++g)
                for (int i = 0; i < STEP; ++i) o[g][i] = vload(acc[g][d0 + i]);
            for (int u = 0; u < tiles; ++u)
                for (int k = 0; k < LANES; ++k) {
                    vec p[G];
                    for (int g = 0; g < G; ++g) p[g] = vload(scores[g][u * LANES + k]);
                    const float* value = values[u] + k * head_dim + d0;
                    for (int i = 0; i < STEP; ++i) {
                        const vec x = splat(value[i]);
                        for (int g = 0; g < G; ++g) o[g][i] += x * p[g];
                    }
                }
            for (int g = 0; g < G; ++g)
                for (int i = 0; i < STEP; ++i) vstore(acc[g][d0 + i], o[g][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < rows; ++r) {
            const float inv = 1.0f / total[g][r];
            for (int64_t d = 0; d < head_dim; ++d)
                store(out, ((row0 + r) * q_heads + h0 + g) * head_dim + d, acc[g][d][r] * inv);
        }
}

template <typename T, int64_t HeadDim>
void prefill(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* table,
             int64_t start, int64_t chunk, int64_t kv_heads, int64_t group, int64_t head_dim,
             int64_t num_blocks, int64_t block_size, float scale, int64_t window, float softcap,
             int threads) {
    const int64_t q_heads = kv_heads * group, head_stride = num_blocks * block_size * head_dim;
    const int64_t blocks = (chunk + LANES - 1) / LANES;
    const int heads = group % 2 == 0 ? 2 : 1;  // query heads per task, of one KV head
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < q_heads / heads * blocks; ++task) {
        const int64_t h = task / blocks * heads, row0 = task % blocks * LANES;
        const int rows = static_cast<int>(std::min<int64_t>(LANES, chunk - row0));
        const T* k_head = k_cache + (h / group) * head_stride;
        const T* v_head = v_cache + (h / group) * head_stride;
        if (heads == 2)
            prefill_rows<T, HeadDim, 2>(q, k_head, v_head, out, table, h, q_heads, row0, rows,
                                        start, start + chunk, head_dim, block_size, scale,
                                        window, softcap);
        else
            prefill_rows<T, HeadDim, 1>(q, k_head, v_head, out, table, h, q_heads, row0, rows,
                                        start, start + chunk, head_dim, block_size, scale,
                                        window, softcap);
    }
}

// Calls run(T{}, std::integral_constant<int64_t, HeadDim>{}) with the element type and the
// head size fixed at compile time where it is a common one (64, 128; else 0: given at run time).
template <typename Run>
void dispatch(int bf16, int64_t head_dim, Run run) {
    auto by_size = [&](auto element) {
        if (head_dim == 64) run(element, std::integral_constant<int64_t, 64>{});
        else if (head_dim == 128) run(element, std::integral_constant<int64_t, 128>{});
        else run(element, std::integral_constant<int64_t, 0>{});
    };
    by_dtype(bf16, by_size);
}

}  // namespace

extern "C" {

// q, out: [chunk, kv_heads * group, head_dim], the chunk's rows, whose keys and values are
// already in the caches; table: the request's block ids; start: the chunk's first position.
// head_dim: a multiple of 16, at most MAX_HEAD_DIM. Other arguments as paged_decode's.
void paged_prefill(const void* q, const void* k_cache, const void* v_cache, void* out,
                   const int64_t* table, int64_t start, int64_t chunk, int64_t kv_heads,
                   int64_t group, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                   float scale, int64_t window, float softcap, int bf16, int threads) {
    dispatch(bf16, head_dim, [&](auto element, auto fixed) {
        using T = decltype(element);
        prefill<T, decltype(fixed)::value>(
            static_cast<const T*>(q), static_cast<const T*>(k_cache),
            static_cast<const T*>(v_cache), static_cast<T*>(out), table, start, chunk,
            kv_heads, group, head_dim, num_blocks, block_size, scale, window, softcap, threads);
    });
}

// q: [batch, kv_heads * group, head_dim], rows q_stride elements apart (a slice of the fused
// q/k/v projection is read in place); out: the same shape, contiguous; caches: [kv_heads,
// num_blocks, block_size, head_dim]; tables: [batch, table_width] block ids; lengths: [batch]
// keys per request (its position + 1). window > 0 keeps the last `window` keys; softcap > 0
// caps scores. bf16 != 0: every tensor is bfloat16 (accumulation stays float), else float32.
void paged_decode(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                  void* out, const int64_t* tables, const int64_t* lengths, int64_t batch,
                  int64_t table_width, int64_t kv_heads, int64_t group, int64_t head_dim,
                  int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                  float softcap, int bf16, int threads) {
    dispatch(bf16, head_dim, [&](auto element, auto fixed) {
        using T = decltype(element);
        attend<T, decltype(fixed)::value>(
            static_cast<const T*>(q), q_stride, static_cast<const T*>(k_cache),
            static_cast<const T*>(v_cache), static_cast<T*>(out), tables, lengths, batch,
            table_width, kv_heads, group, head_dim, num_blocks, block_size, scale, window,
            softcap, threads);
    });
}

}  // extern "C"
