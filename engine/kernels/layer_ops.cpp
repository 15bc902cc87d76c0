// The dense ops of a decoder layer on CPU, each one call where torch runs several small ops:
// - linear_rows: y = x W^T (+ b) for a few rows, over weights packed in panels
//   (cpu_kernels.pack_panels) streamed once, every row's sums kept in registers.
// - rms_norm: the residual add and the norm in one pass, rounded as the torch module rounds.
// - silu_mul; rope on q and k in place; cache_write of a step's keys and values.
// Sums run in a different order than torch's, so results may differ in the last bit.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vectors.h"

namespace {

using namespace tokenflow;

// ---- linear_rows ----------------------------------------------------------------------------

// A panel's outputs in vectors, and the rows one pass over a panel computes: the sums
// (rows x vectors), the panel's vectors and a broadcast must fit the registers, 32 with
// AVX-512 (8 x 3 sums), 16 with AVX2 (6 x 2, as BLAS's AVX2 kernels tile).
#ifdef __AVX512F__
constexpr int VECTORS = 3;
constexpr int64_t MAX_ROWS = 8;
#else
constexpr int VECTORS = 2;
constexpr int64_t MAX_ROWS = 6;
#endif
constexpr int64_t PANEL = VECTORS * LANES;
// Floats ahead of the read position prefetched into L2: about one memory latency.
constexpr int64_t AHEAD = 1024;

// `Rows` rows of x [Rows, K] against one panel [K][Vectors * LANES] -> y's `cols` columns.
template <int Rows, int Vectors>
inline void panel_rows(const float* x, const float* panel, int64_t k_size, float* y,
                       int64_t ldy, int64_t cols, const float* bias) {
    constexpr int64_t width = Vectors * LANES;
    vec sums[Rows][Vectors];
    for (int r = 0; r < Rows; ++r)
        for (int j = 0; j < Vectors; ++j) sums[r][j] = vec{};
    for (int64_t k = 0; k < k_size; ++k) {
        const float* w = panel + k * width;
        vec weights[Vectors];
#pragma GCC unroll 4
        for (int j = 0; j < Vectors; ++j) {
            __builtin_prefetch(w + AHEAD + j * LANES, 0, 2);
            weights[j] = vload(w + j * LANES);
        }
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
            vec xb = splat(x[r * k_size + k]);
#pragma GCC unroll 4
            for (int j = 0; j < Vectors; ++j) sums[r][j] += xb * weights[j];
        }
    }
    for (int r = 0; r < Rows; ++r) {
        alignas(64) float row[width];
        for (int j = 0; j < Vectors; ++j) vstore(row + j * LANES, sums[r][j]);
        for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = row[c] + (bias ? bias[c] : 0.0f);
    }
}

// panel_rows at run-time rows (1..MAX_ROWS) and vectors (1..VECTORS)
template <int Rows = 1, int Vectors = 1>
void panel_rows_of(int64_t rows, int64_t vectors, const float* x, const float* panel,
                   int64_t k_size, float* y, int64_t ldy, int64_t cols, const float* bias) {
    if constexpr (Vectors <= VECTORS) {
        if (vectors != Vectors)
            return panel_rows_of<Rows, Vectors + 1>(rows, vectors, x, panel, k_size, y, ldy,
                                                    cols, bias);
        if constexpr (Rows <= MAX_ROWS) {
            if (rows != Rows)
                return panel_rows_of<Rows + 1, Vectors>(rows, vectors, x, panel, k_size, y,
                                                        ldy, cols, bias);
            panel_rows<Rows, Vectors>(x, panel, k_size, y, ldy, cols, bias);
        }
    }
}

// ---- rms_norm, silu_mul, rope, cache_write -------------------------------------------------

template <typename T>
void norm_rows(const T* delta, T* residual, const T* weight, T* out, int64_t rows,
               int64_t dim, float eps, float offset, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const T* in = delta + r * dim;
        T* held = residual ? residual + r * dim : nullptr;
        T* o = out + r * dim;
        float squares = 0.0f;
        for (int64_t i = 0; i < dim; ++i) {
            float value = load(in, i);
            if (held) {  // the residual stream gains the block's output, rounded as stored
                value = round_to<T>(load(held, i) + value);
                store(held, i, value);
            }
            squares += value * value;
        }
        float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
        const T* source = held ? held : in;
        for (int64_t i = 0; i < dim; ++i) {
            float normed = load(source, i) * scale;
            // Gemma scales in float by (offset + w); Llama casts first, then multiplies by w
            store(o, i, offset != 0.0f ? normed * (offset + load(weight, i))
                                       : load(weight, i) * round_to<T>(normed));
        }
    }
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * 2 * inter;
        const T* up = gate + inter;
        for (int64_t i = 0; i < inter; ++i) {
            float g = load(gate, i);
            store(out, r * inter + i, round_to<T>(g / (1.0f + expf(-g))) * load(up, i));
        }
    }
}

// One head's row rotated in place by its position (rotate-half: the halves pair up),
// rounded after each product as torch's elementwise ops round.
template <typename T>
inline void rotate_row(T* row, const T* cos, const T* sin, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        float x1 = load(row, i), x2 = load(row, half + i), c = load(cos, i), s = load(sin, i);
        store(row, i, round_to<T>(x1 * c) - round_to<T>(x2 * s));
        store(row, half + i, round_to<T>(x2 * c) + round_to<T>(x1 * s));
    }
}

template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads,
               int64_t head_dim, int64_t row_stride, int threads) {
    const int64_t half = head_dim / 2;
    const int64_t work = rows * heads * head_dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (work > (1 << 16))
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            T* row = x + r * row_stride + h * head_dim;
            rotate_row(row, cos + r * half, sin + r * half, half);
        }
}

template <typename T>
void cache_write_rows(const T* k, const T* v, T* k_cache, T* v_cache, const int64_t* slots,
                      int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t k_stride,
                      int64_t v_stride, int64_t cache_slots) {
    const size_t bytes = head_dim * sizeof(T);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < kv_heads; ++h) {  // the cache is [kv_heads, slots, head_dim]
            const int64_t at = (h * cache_slots + slots[r]) * head_dim;
            std::memcpy(k_cache + at, k + r * k_stride + h * head_dim, bytes);
            std::memcpy(v_cache + at, v + r * v_stride + h * head_dim, bytes);
        }
}

}  // namespace

extern "C" {

// y [rows, n] = x [rows, k] W^T + bias (bias may be null), W packed by
// cpu_kernels.pack_panels: panels of PANEL outputs, [k][PANEL] each, then the last n % PANEL
// outputs (padded to whole vectors) as one narrower panel. Panels are split among `threads`;
// rows past MAX_ROWS take further passes over each panel, which then comes from L2.
void linear_rows(const float* x, int64_t rows, int64_t k, const float* panels, int64_t n,
                 float* y, const float* bias, int threads) {
    const int64_t count = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < count; ++p) {
        const int64_t first = p * PANEL, cols = n - first < PANEL ? n - first : PANEL;
        const int64_t vectors = (cols + LANES - 1) / LANES;
        for (int64_t r = 0; r < rows; r += MAX_ROWS)
            panel_rows_of(rows - r < MAX_ROWS ? rows - r : MAX_ROWS, vectors, x + r * k,
                          panels + first * k, k, y + r * n + first, n, cols,
                          bias ? bias + first : nullptr);
    }
}

// out [rows, dim] = the norm of (residual += delta) when residual is not null, else of delta;
// weight [dim]; offset 1 for Gemma's (1 + w) norms, else 0.
void rms_norm(const void* delta, void* residual, const void* weight, void* out, int64_t rows,
              int64_t dim, float eps, float offset, int bf16, int threads) {
    by_dtype(bf16, [&](auto element) {
        using T = decltype(element);
        norm_rows(static_cast<const T*>(delta), static_cast<T*>(residual),
                  static_cast<const T*>(weight), static_cast<T*>(out), rows, dim, eps, offset,
                  threads);
    });
}

// gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter].
void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int bf16,
              int threads) {
    by_dtype(bf16, [&](auto element) {
        using T = decltype(element);
        silu_mul_rows(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, inter,
                      threads);
    });
}

// Rotates the first `heads` heads of each row of x in place: row r starts at r * row_stride,
// its heads are head_dim apart; cos, sin [rows, head_dim / 2].
void rope(void* x, const void* cos, const void* sin, int64_t rows, int64_t heads,
          int64_t head_dim, int64_t row_stride, int bf16, int threads) {
    by_dtype(bf16, [&](auto element) {
        using T = decltype(element);
        rope_rows(static_cast<T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
                  rows, heads, head_dim, row_stride, threads);
    });
}

// k, v: rows of kv_heads * head_dim, k_stride and v_stride apart -> one layer's caches
// [kv_heads, cache_slots, head_dim] at each row's slot.
void cache_write(const void* k, const void* v, void* k_cache, void* v_cache,
                 const int64_t* slots, int64_t rows, int64_t kv_heads, int64_t head_dim,
                 int64_t k_stride, int64_t v_stride, int64_t cache_slots, int bf16) {
    by_dtype(bf16, [&](auto element) {
        using T = decltype(element);
        cache_write_rows(static_cast<const T*>(k), static_cast<const T*>(v),
                         static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots, rows,
                         kv_heads, head_dim, k_stride, v_stride, cache_slots);
    });
}

// linear_rows's weight layout, for cpu_kernels.pack_panels: layout[0] = floats per vector
// (LANES), layout[1] = outputs per panel (PANEL).
void vector_layout(int64_t* layout) {
    layout[0] = LANES;
    layout[1] = PANEL;
}

}  // extern "C"
