// Attention over the paged KV cache, read in place (issue 18): every decode of a step in one
// call (paged_decode), and one prefill chunk per call (paged_prefill, below).
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
#include <math.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {


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
    if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN, tested on the bits (-ffast-math)
        p[i] = 0x7fc0;
        return;
    }
    bits += 0x7fff + ((bits >> 16) & 1);
    p[i] = static_cast<uint16_t>(bits >> 16);
}

// A request's blocks sit anywhere in the pool, where the hardware prefetcher cannot follow
// (it stops at page boundaries): while a block is computed, the block AHEAD places on is
// fetched row by row, or every block starts with a stall on memory (a walk without it read
// the blocks at half the bandwidth of a plain copy here).
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

// Two blocks ahead, not one: one block's compute is about one memory latency, so the last
// rows of the next block arrived late (one layer at 64 requests x 900 tokens: 10.0 ms at
// one block ahead, 9.0 at two, 9.4 at three).
constexpr int64_t AHEAD = 2;

// Calls visit(row, index) for the cached rows of positions [first, length) of one head, in
// order, block by block (no division per key), prefetching AHEAD blocks ahead. `companion`,
// another cache's slice laid out like `head` (the values beside the keys), is prefetched at
// the same places, so that a later walk over it reads from L2 (8.2 against 9.0 ms above).
template <typename T, typename Visit>
inline void walk(const T* head, const int64_t* table, int64_t first, int64_t length,
                 int64_t block_size, int64_t head_dim, Visit visit,
                 const T* companion = nullptr) {
    const int64_t row_stride = head_dim, block_stride = block_size * head_dim;
    const int64_t last_block = (length - 1) / block_size;
    const int64_t first_block = first / block_size;
    for (int64_t block = first_block + 1; block < first_block + AHEAD && block <= last_block;
         ++block)
        for (int64_t t = 0; t < block_size; ++t)
            fetch_pair(head, companion, table[block] * block_stride + t * row_stride, head_dim);
    for (int64_t pos = first; pos < length;) {
        const int64_t block = pos / block_size, offset = pos % block_size;
        const int64_t span = std::min(block_size - offset, length - pos);
        const T* rows = head + table[block] * block_stride + offset * row_stride;
        // where the block AHEAD places on starts, in elements; -1 past the last block
        const int64_t ahead = block + AHEAD <= last_block ? table[block + AHEAD] * block_stride
                                                          : -1;
        for (int64_t t = 0; t < span; ++t) {
            if (ahead >= 0)
                fetch_pair(head, companion, ahead + (offset + t) * row_stride, head_dim);
            visit(rows + t * row_stride, pos - first + t);
        }
        if (ahead >= 0)  // a first block entered mid-way: the rest of its successor
            for (int64_t t = 0; t < offset; ++t)
                fetch_pair(head, companion, ahead + t * row_stride, head_dim);
        pos += span;
    }
}

// HeadDim > 0 fixes the head size at compile time (the common 64 and 128): the loops over it
// unroll and a head's accumulator stays in registers (measured 1.4x on the in-cache compute).
template <typename T, int64_t HeadDim>
void attend(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* tables,
            const int64_t* lengths, int64_t batch, int64_t table_width, int64_t kv_heads,
            int64_t group, int64_t runtime_head_dim, int64_t num_blocks, int64_t block_size,
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
                    query[g * head_dim + d] = load(q, (b * q_heads + kh * group + g) * head_dim + d);
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
            // one query head at a time: its accumulator fits in registers; the rows come from
            // L2 for every head after the first (a request's values for one KV head are small)
            for (int64_t g = 0; g < group; ++g) {
                const float* __restrict sg = scores + g * keys;
                auto accumulate = [&](float* __restrict ag) {
                    walk(v_cache + kh * head_stride, table, first, length, block_size, head_dim,
                         [&](const T* __restrict value, int64_t i) {
                             const float w = sg[i];
#pragma omp simd
                             for (int64_t d = 0; d < head_dim; ++d) ag[d] += w * load(value, d);
                         });
                };
                if constexpr (HeadDim > 0) {  // a local of fixed size can live in registers
                    float local[HeadDim] = {};
                    accumulate(local);
                    std::memcpy(acc + g * head_dim, local, sizeof local);
                } else {
                    accumulate(acc + g * head_dim);
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
// Flash-style (online softmax over tiles of keys), so no score matrix larger than a tile
// exists. Per KV head, a segment of the request's keys is copied out of its blocks once:
// keys transposed ([head_dim][keys]) so that 16 keys' scores build in one vector, values as
// rows. Blocks of ROWS query rows then stream the segment from L2: scores by a ROWS x COLS
// register tile over head_dim, the tile's softmax, then P·V by a ROWS x 32 tile over keys.
// torch's CPU flash kernel, over a gathered copy, ran a 512-token chunk at 36-60 GFLOP/s
// here; this at 62-78 (of a 98 GFLOP/s matmul peak).

typedef float v16 __attribute__((vector_size(64)));  // GCC/Clang vectors: AVX-512, or 2x AVX2

constexpr int ROWS = 8;    // query rows per block: 16 score accumulators, 8 broadcasts a step
constexpr int COLS = 32;   // keys per score tile (two vectors)
constexpr int TILE = 128;  // keys per softmax step
constexpr int MAX_HEAD_DIM = 256;
constexpr int64_t SEGMENT_FLOATS = 65536;  // keys x head_dim per copied segment: 256 KB each
constexpr float MASKED = -1e30f;  // finite: the library is built with -ffast-math

inline v16 vload(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }

// A segment's keys [first, first + keys), copied out of one head's blocks.
struct Segment {
    const float* keys_t;  // [head_dim][stride]
    const float* values;  // [stride][head_dim]
    int64_t first, keys, stride;
};

// Softmax state of ROWS query rows, kept across segments in the caller's scratch.
struct RowsState {
    float* out;  // [ROWS][head_dim], unnormalised
    float* top;  // [ROWS] running max
    float* sum;  // [ROWS] running sum of exp
};

// O += P·V for one tile: `scores` [ROWS][TILE] already exponentiated (0 where masked).
template <int Width>  // vectors of head_dim per pass: 2 (32 values) or 1 (16)
inline void accumulate_values(const float (&scores)[ROWS][TILE], int64_t n, const float* values,
                              int64_t head_dim, int64_t h, float (&out)[ROWS][MAX_HEAD_DIM]) {
    v16 acc[ROWS][Width];
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < Width; ++w) acc[r][w] = vload(&out[r][h + 16 * w]);
    for (int64_t j = 0; j < n; ++j) {
        v16 v[Width];
        for (int w = 0; w < Width; ++w) v[w] = vload(values + j * head_dim + h + 16 * w);
        for (int r = 0; r < ROWS; ++r) {
            const v16 p = splat(scores[r][j]);
            for (int w = 0; w < Width; ++w) acc[r][w] += p * v[w];
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < Width; ++w) vstore(&out[r][h + 16 * w], acc[r][w]);
}

// Query rows [row0, row0 + rows) of one head (positions start + row), scaled by the
// softmax scale already, against the segment's keys they may see.
void attend_rows(const float (&query)[ROWS][MAX_HEAD_DIM], int rows, int64_t row0,
                 int64_t start, int64_t head_dim, int64_t window, float softcap,
                 const Segment& seg, const RowsState& state) {
    alignas(64) float out[ROWS][MAX_HEAD_DIM];
    alignas(64) float scores[ROWS][TILE];
    const int64_t first_pos = start + row0, last_pos = first_pos + rows - 1;
    int64_t lo = seg.first;
    if (window > 0) lo = std::max(lo, first_pos - window + 1);
    lo = seg.first + (lo - seg.first) / COLS * COLS;  // tiles start on the copy's columns
    const int64_t hi = std::min(seg.first + seg.keys, last_pos + 1);
    if (lo >= hi) return;
    for (int r = 0; r < ROWS; ++r)
        for (int64_t d = 0; d < head_dim; ++d) out[r][d] = r < rows ? state.out[r * head_dim + d] : 0;
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
        const int64_t n = (std::min<int64_t>(TILE, hi - t0) + COLS - 1) / COLS * COLS;
        for (int64_t c = 0; c < n; c += COLS) {
            const float* keys = seg.keys_t + (t0 - seg.first) + c;
            v16 acc[ROWS][2] = {};
            for (int64_t d = 0; d < head_dim; ++d) {
                const v16 k0 = vload(keys + d * seg.stride), k1 = vload(keys + d * seg.stride + 16);
                for (int r = 0; r < ROWS; ++r) {
                    const v16 q = splat(query[r][d]);
                    acc[r][0] += q * k0;
                    acc[r][1] += q * k1;
                }
            }
            for (int r = 0; r < ROWS; ++r) {
                vstore(&scores[r][c], acc[r][0]);
                vstore(&scores[r][c + 16], acc[r][1]);
            }
        }
        // a tile every row sees whole: before the first row's position, inside every window
        const bool whole = t0 + n <= first_pos + 1 && t0 + n <= seg.first + seg.keys &&
                           (window <= 0 || t0 > last_pos - window);
        for (int r = 0; r < ROWS; ++r) {
            float* s = scores[r];
            if (r >= rows) {  // padding rows weigh nothing
                std::fill(s, s + n, 0.0f);
                continue;
            }
            const int64_t pos = first_pos + r;
            if (softcap > 0.0f)
                for (int64_t j = 0; j < n; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
            if (!whole)
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t key = t0 + j;
                    const bool seen = key <= pos && key < seg.first + seg.keys &&
                                      (window <= 0 || key > pos - window);
                    s[j] = seen ? s[j] : MASKED;
                }
            float top = state.top[r];
            for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
            if (top <= MASKED) {  // none of this row's keys in the tile yet
                std::fill(s, s + n, 0.0f);
                continue;
            }
            const float rescale = state.top[r] <= MASKED ? 0.0f : expf(state.top[r] - top);
            float total = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                const float p = s[j] > MASKED ? expf(s[j] - top) : 0.0f;
                s[j] = p;
                total += p;
            }
            state.top[r] = top;
            state.sum[r] = state.sum[r] * rescale + total;
            for (int64_t d = 0; d < head_dim; ++d) out[r][d] *= rescale;
        }
        const float* values = seg.values + (t0 - seg.first) * head_dim;
        int64_t h = 0;
        for (; h + 32 <= head_dim; h += 32) accumulate_values<2>(scores, n, values, head_dim, h, out);
        if (h < head_dim) accumulate_values<1>(scores, n, values, head_dim, h, out);
    }
    for (int r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d) state.out[r * head_dim + d] = out[r][d];
}

template <typename T>
void prefill(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* table,
             int64_t start, int64_t chunk, int64_t kv_heads, int64_t group, int64_t head_dim,
             int64_t num_blocks, int64_t block_size, float scale, int64_t window, float softcap,
             int threads) {
    const int64_t length = start + chunk;
    const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    const int64_t q_heads = kv_heads * group, head_stride = num_blocks * block_size * head_dim;
    const int64_t span = std::max<int64_t>(TILE, SEGMENT_FLOATS / head_dim / TILE * TILE);
    const int64_t stride = span + COLS;  // a last tile reads up to a whole score tile
    const int64_t row_blocks = (chunk + ROWS - 1) / ROWS;
    std::vector<float> acc(q_heads * chunk * head_dim, 0.0f), top(q_heads * chunk, MASKED),
        sum(q_heads * chunk, 0.0f), keys_t(head_dim * stride), values(stride * head_dim);
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
        const T* k_head = k_cache + kh * head_stride;
        const T* v_head = v_cache + kh * head_stride;
        for (int64_t s0 = first; s0 < length; s0 += span) {
            const int64_t keys = std::min(span, length - s0);
            const int64_t copied = (keys + COLS - 1) / COLS * COLS;  // what tiles read
#pragma omp for schedule(static)
            for (int64_t i = 0; i < copied; ++i) {
                const int64_t pos = s0 + i;
                const int64_t row = i < keys ? (table[pos / block_size] * block_size
                                                + pos % block_size) * head_dim : -1;
                for (int64_t d = 0; d < head_dim; ++d) {
                    keys_t[d * stride + i] = row >= 0 ? load(k_head, row + d) : 0.0f;
                    values[i * head_dim + d] = row >= 0 ? load(v_head, row + d) : 0.0f;
                }
            }
            const Segment seg{keys_t.data(), values.data(), s0, keys, stride};
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < group * row_blocks; ++task) {
                const int64_t h = kh * group + task / row_blocks;
                const int64_t row0 = task % row_blocks * ROWS;
                const int rows = static_cast<int>(std::min<int64_t>(ROWS, chunk - row0));
                alignas(64) float query[ROWS][MAX_HEAD_DIM];
                for (int r = 0; r < ROWS; ++r)
                    for (int64_t d = 0; d < head_dim; ++d)
                        query[r][d] = r < rows ? load(q, ((row0 + r) * q_heads + h) * head_dim + d) * scale
                                               : 0.0f;
                const int64_t at = h * chunk + row0;
                attend_rows(query, rows, row0, start, head_dim, window, softcap, seg,
                            RowsState{acc.data() + at * head_dim, top.data() + at, sum.data() + at});
            }
        }
    }
    for (int64_t h = 0; h < q_heads; ++h)
        for (int64_t r = 0; r < chunk; ++r) {
            const float inv = 1.0f / sum[h * chunk + r];
            const float* row = acc.data() + (h * chunk + r) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d)
                store(out, (r * q_heads + h) * head_dim + d, row[d] * inv);
        }
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
    auto run = [&](auto element) {
        using T = decltype(element);
        prefill<T>(static_cast<const T*>(q), static_cast<const T*>(k_cache),
                   static_cast<const T*>(v_cache), static_cast<T*>(out), table, start, chunk,
                   kv_heads, group, head_dim, num_blocks, block_size, scale, window, softcap,
                   threads);
    };
    if (bf16) run(uint16_t{});
    else run(float{});
}

// q, out: [batch, kv_heads * group, head_dim]; caches: [kv_heads, num_blocks, block_size,
// head_dim]; tables: [batch, table_width] block ids; lengths: [batch] keys per request
// (its position + 1). window > 0 keeps the last `window` keys; softcap > 0 caps scores.
// bf16 != 0: every tensor is bfloat16 (accumulation stays float), else float32.
void paged_decode(const void* q, const void* k_cache, const void* v_cache, void* out,
                  const int64_t* tables, const int64_t* lengths, int64_t batch,
                  int64_t table_width, int64_t kv_heads, int64_t group, int64_t head_dim,
                  int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                  float softcap, int bf16, int threads) {
    auto run = [&](auto element, auto fixed) {
        using T = decltype(element);
        attend<T, decltype(fixed)::value>(
            static_cast<const T*>(q), static_cast<const T*>(k_cache),
            static_cast<const T*>(v_cache), static_cast<T*>(out), tables, lengths, batch,
            table_width, kv_heads, group, head_dim, num_blocks, block_size, scale, window,
            softcap, threads);
    };
    auto by_size = [&](auto element) {
        if (head_dim == 64) run(element, std::integral_constant<int64_t, 64>{});
        else if (head_dim == 128) run(element, std::integral_constant<int64_t, 128>{});
        else run(element, std::integral_constant<int64_t, 0>{});
    };
    if (bf16) by_size(uint16_t{});
    else by_size(float{});
}

}  // extern "C"
