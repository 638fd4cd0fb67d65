// The work of a CPU decode step between its matrix products, one loop each instead of PyTorch's chains of small
// operations (backend/layers/decode_ops.py says why and when they are used; docs/performance.md measures them).
//
// Each function does in one pass what its reference in fused_ops.py does in several PyTorch
// operations, with float arithmetic throughout and one rounding to the output's dtype, where the
// reference rounds after every operation. Activations are float32 or bfloat16; the KV cache is
// float32 or bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "fused_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

// Attention over a bfloat16 cache is written for 512-bit vectors where the CPU has them (the compiler takes 256
// bits), and with AVX-512 BF16's dot products (vdpbf16ps) multiplies the keys as they are stored, where the loop
// otherwise converts each to float first.
#ifdef __AVX512F__
#define ATTENTION_AVX512 1
#include <immintrin.h>
#endif
#if defined(ATTENTION_AVX512) && defined(__AVX512BF16__)
#define ATTENTION_BF16_DOTS 1
#endif

namespace fused_ops {

using c10::BFloat16;

// Rows of at least this many elements are shared between threads one at a time; fewer are not worth
// waking a thread for.
constexpr int64_t GRAIN = 16384;

int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, GRAIN / std::max<int64_t>(width, 1)); }

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_cpu_float(const at::Tensor& t, const char* name) {
  check_cpu_contiguous(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
}

// Calls f with a null pointer of the C++ type of dtype (float32 or bfloat16), for dispatch on it.
template <typename F>
void with_float_type(at::ScalarType dtype, const char* name, F&& f) {
  if (dtype == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (dtype == at::kBFloat16) {
    f(static_cast<BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, name, " must be float32 or bfloat16, not ", dtype);
  }
}

// Reductions keep LANES partial results, one per vector lane, so that the compiler vectorizes them
// (a single running sum or maximum is a chain it may not reorder).
constexpr int64_t LANES = 16;

// The mean of one row of width d.
template <typename T>
float row_mean(const T* x, int64_t d) {
  float partial[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    for (int64_t lane = 0; lane < LANES; ++lane) partial[lane] += static_cast<float>(x[i + lane]);
  }
  float sum = 0.f;
  for (; i < d; ++i) sum += static_cast<float>(x[i]);
  for (float p : partial) sum += p;
  return sum / d;
}

// out = x / sqrt(mean(x^2) + eps) * weight for one row of width d; where `centered` (Cohere's LayerNorm,
// without a bias), x less its mean in place of x. (x - 0 is x exactly: the RMSNorm's numbers are as before.)
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t d, float eps, bool centered = false) {
  const float mean = centered ? row_mean(x, d) : 0.f;
  float partial[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    for (int64_t lane = 0; lane < LANES; ++lane) {
      const float v = static_cast<float>(x[i + lane]) - mean;
      partial[lane] += v * v;
    }
  }
  float sum = 0.f;
  for (; i < d; ++i) sum += (static_cast<float>(x[i]) - mean) * (static_cast<float>(x[i]) - mean);
  for (float p : partial) sum += p;
  const float inverse = 1.f / std::sqrt(sum / d + eps);
  for (int64_t j = 0; j < d; ++j) {
    out[j] = static_cast<T>((static_cast<float>(x[j]) - mean) * inverse * static_cast<float>(weight[j]));
  }
}

// e^x to about 2 units in the last place, branch-free so that the compiler vectorizes it (std::exp is
// a library call per element): Cody and Waite's reduction to x = n ln 2 + r, Cephes' polynomial for e^r.
// NaN gives NaN, and e^-inf 0 (as every x below the clamp, whose e^x is at most a subnormal): a masked
// score or a NaN must not come out as e^-87.3 or as a finite number. e^inf is inf (n = 128 there).
inline float vector_exp(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);  // NaN stays NaN: std::max(NaN, y) is NaN
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, clamped);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.f;  // NaN where x is
  // 2^n; NaN's n is taken as 0, since casting NaN to an integer is undefined behaviour.
  const int32_t bits = (static_cast<int32_t>(clamped == clamped ? n : 0.f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.f : p * scale;
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool centered) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  const int64_t d = x.size(-1), n = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.numel() == d, "weight must have x's last dimension");
  at::Tensor out = at::empty_like(x);
  with_float_type(x.scalar_type(), "x", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, rows_per_task(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(xp + r * d, wp, op + r * d, d, static_cast<float>(eps), centered);
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return norm(x, weight, eps, false); }

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return norm(x, weight, eps, true); }

// The RMSNorm of each query head with query_weight, and of each key head with key_weight, in place in a
// step's q, k and v side by side ([rows, (heads + 2 kv_heads) * head_dim]; the values untouched): Qwen3's
// and Gemma 3's norms of each head before the rotation. Each weight's width is the span it norms: a head's
// (those), or all the query heads' and all the key heads' (OLMo 2's norms of q and k whole). As PyTorch's
// operations on the heads' views, a split, two norms and a join, they took 130 us a layer of a one-row
// bfloat16 step (Qwen3-30B-A3B's shape: 32 query heads and 4 key heads of 128), 0.5 ms of a 4-layer
// model's 9.8.
at::Tensor head_rms_norms(at::Tensor& qkv, const at::Tensor& query_weight, const at::Tensor& key_weight,
                          int64_t heads, int64_t kv_heads, double query_eps, double key_eps) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(query_weight, "query_weight");
  check_cpu_contiguous(key_weight, "key_weight");
  const int64_t width = qkv.size(-1), qd = query_weight.numel(), kd = key_weight.numel();
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  TORCH_CHECK(width % (heads + 2 * kv_heads) == 0, "qkv must be [rows, (heads + 2 kv_heads) * head_dim]");
  const int64_t head_dim = width / (heads + 2 * kv_heads);
  TORCH_CHECK(qd > 0 && kd > 0 && (heads * head_dim) % qd == 0 && (kv_heads * head_dim) % kd == 0 &&
                  qd % head_dim == 0 && kd % head_dim == 0,
              "each weight must be a head's width, or a whole number of heads'");
  TORCH_CHECK(query_weight.scalar_type() == qkv.scalar_type() && key_weight.scalar_type() == qkv.scalar_type(),
              "qkv and the weights must have one dtype");
  const int64_t rows = qkv.numel() / width, query_spans = heads * head_dim / qd;
  const int64_t spans = query_spans + kv_heads * head_dim / kd;
  with_float_type(qkv.scalar_type(), "qkv", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    T* p = qkv.data_ptr<T>();
    const T* qw = query_weight.data_ptr<T>();
    const T* kw = key_weight.data_ptr<T>();
    at::parallel_for(0, rows * spans, rows_per_task(std::min(qd, kd)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = i / spans, span = i % spans;
        const bool query = span < query_spans;
        T* x = p + row * width + (query ? span * qd : heads * head_dim + (span - query_spans) * kd);
        norm_row(x, query ? qw : kw, x, query ? qd : kd, static_cast<float>(query ? query_eps : key_eps));
      }
    });
  });
  return qkv;
}

// hidden += delta (rounded to hidden's dtype, as `hidden + delta` would be), in place; returns the
// sum's RMSNorm, or where `centered` its LayerNorm (`norm_row`).
at::Tensor add_norm(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps, bool centered) {
  check_cpu_contiguous(hidden, "hidden");
  check_cpu_contiguous(delta, "delta");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(delta.sizes() == hidden.sizes(), "delta must have hidden's shape");
  TORCH_CHECK(delta.scalar_type() == hidden.scalar_type() && weight.scalar_type() == hidden.scalar_type(),
              "hidden, delta and weight must have one dtype");
  const int64_t d = hidden.size(-1), n = hidden.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.numel() == d, "weight must have hidden's last dimension");
  at::Tensor out = at::empty_like(hidden);
  with_float_type(hidden.scalar_type(), "hidden", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    T* hp = hidden.data_ptr<T>();
    const T* dp = delta.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, rows_per_task(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = hp + r * d;
        const T* add = dp + r * d;
        for (int64_t i = 0; i < d; ++i) row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(add[i]));
        norm_row(row, wp, op + r * d, d, static_cast<float>(eps), centered);
      }
    });
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return add_norm(hidden, delta, weight, eps, false);
}

at::Tensor add_layer_norm(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return add_norm(hidden, delta, weight, eps, true);
}

// [rows, 2 * width] -> activation(first half) * second half, [rows, width]: an MLP's gate and up, side by
// side; `activation` of a float, inlined in the loop.
template <typename F>
at::Tensor gated_mul(const at::Tensor& gate_up, F activation) {
  check_cpu_contiguous(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1) / 2, n = gate_up.numel() / std::max<int64_t>(2 * width, 1);
  TORCH_CHECK(gate_up.size(-1) == 2 * width, "gate_up's last dimension must be even");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  with_float_type(gate_up.scalar_type(), "gate_up", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, rows_per_task(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = gp + r * 2 * width;
        const T* up = gate + width;
        for (int64_t i = 0; i < width; ++i) {
          op[r * width + i] = static_cast<T>(activation(static_cast<float>(gate[i])) * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// silu(gate) * up: Llama's MLP.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  return gated_mul(gate_up, [](float g) { return g / (1.f + vector_exp(-g)); });
}

// gelu(gate, tanh approximation) * up: Gemma's MLP (PyTorch's gelu(approximate="tanh"):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))). tanh(u) is 1 - 2 / (e^2u + 1), which gives 1 and -1
// at the ends and keeps NaN.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  return gated_mul(gate_up, [](float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (2.f - 2.f / (vector_exp(2.f * u) + 1.f));
  });
}

// The rotary embedding of one head (transformers' rotate_half form): out = x * cos + rotate_half(x) * sin
// over its first `rotated` elements (cos and sin's width: all of them but in Phi-4-mini, whose
// partial_rotary_factor rotates three quarters, and GLM's half), the rest copied. `interleaved`: each
// element paired with its neighbour, 2t with 2t + 1 (the GLM, ERNIE 4.5 and Helium form, whose cos and sin
// come repeated so: decode_ops.rotate), where rotate_half pairs t with t + rotated / 2.
template <typename T, typename C>
void rotate_head(const T* x, const T* cos, const T* sin, C* out, int64_t head_dim, int64_t rotated, bool interleaved) {
  const int64_t half = rotated / 2;
  for (int64_t t = 0; t < half; ++t) {
    const int64_t first = interleaved ? 2 * t : t, second = interleaved ? 2 * t + 1 : t + half;
    const float a = x[first], b = x[second];
    out[first] = static_cast<C>(a * static_cast<float>(cos[first]) - b * static_cast<float>(sin[first]));
    out[second] = static_cast<C>(b * static_cast<float>(cos[second]) + a * static_cast<float>(sin[second]));
  }
  for (int64_t t = rotated; t < head_dim; ++t) out[t] = static_cast<C>(static_cast<float>(x[t]));
}

// One decode step's queries, keys and values ([queries, (heads + 2 * kv_heads) * head_dim], as the
// fused projection gives them): queries and keys rotated, keys and values written to the layer's
// cache at `slots` (one a query and KV head, in the cache viewed as [-1, head_dim]); returns the
// rotated queries, [queries, heads, head_dim], in the cache's dtype.
at::Tensor rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& slots, at::Tensor& keys, at::Tensor& values, int64_t heads,
                            int64_t kv_heads, bool interleaved) {
  for (const auto& [t, name] : {std::pair{&qkv, "qkv"}, {&cos, "cos"}, {&sin, "sin"}, {&slots, "slots"},
                                {&keys, "keys"}, {&values, "values"}}) {
    check_cpu_contiguous(*t, name);
  }
  const int64_t head_dim = keys.size(-1), queries = qkv.size(0);
  // The rotation pairs element t with t + rotated / 2: an odd width left one unwritten (at::empty's
  // contents in the query), and 0 divides by zero below.
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even and positive, not ", head_dim);
  const int64_t rotated = cos.dim() > 0 ? cos.size(-1) : 0;
  TORCH_CHECK(rotated > 0 && rotated % 2 == 0 && rotated <= head_dim, "cos and sin's width must be even, positive and at most head_dim (", head_dim, "), not ", rotated);
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive, not ", heads, " and ", kv_heads);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv must be [queries, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(cos.numel() == queries * rotated && sin.numel() == queries * rotated, "cos and sin must be [queries, the width rotated]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos and sin must have qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == queries * kv_heads, "slots must be int64, one a query and KV head");
  TORCH_CHECK(values.scalar_type() == keys.scalar_type() && values.sizes() == keys.sizes(), "keys and values must match");
  const int64_t cache_slots = keys.numel() / head_dim;
  at::Tensor query = at::empty({queries, heads, head_dim}, qkv.options().dtype(keys.scalar_type()));
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < queries * kv_heads; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < cache_slots, "slot ", slot[i], " is outside the cache");
  }
  with_float_type(qkv.scalar_type(), "qkv", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    with_float_type(keys.scalar_type(), "the cache", [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      const T* qp = qkv.data_ptr<T>();
      const T* cp = cos.data_ptr<T>();
      const T* sp = sin.data_ptr<T>();
      C* kp = keys.data_ptr<C>();
      C* vp = values.data_ptr<C>();
      C* out = query.data_ptr<C>();
      const int64_t width = (heads + 2 * kv_heads) * head_dim;
      at::parallel_for(0, queries, rows_per_task(width), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const T* row = qp + i * width;
          const T* c = cp + i * rotated;
          const T* s = sp + i * rotated;
          for (int64_t h = 0; h < heads; ++h) {
            rotate_head(row + h * head_dim, c, s, out + (i * heads + h) * head_dim, head_dim, rotated, interleaved);
          }
          for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t at = slot[i * kv_heads + h] * head_dim;
            rotate_head(row + (heads + h) * head_dim, c, s, kp + at, head_dim, rotated, interleaved);
            const T* value = row + (heads + kv_heads + h) * head_dim;
            for (int64_t t = 0; t < head_dim; ++t) vp[at + t] = static_cast<C>(static_cast<float>(value[t]));
          }
        }
      });
    });
  });
  return query;
}

// The head sizes and query groups decode_attention takes: the head size is a template argument, so
// that the compiler unrolls the loops over it and keeps a key or value row in registers (twice as
// fast as a run-time size, and the head sizes of nearly all models); fused_ops.py sends others to
// PyTorch's attention.
constexpr int64_t HEAD_DIMS[] = {64, 96, 128, 256};  // 96: Phi-3-mini's and Phi-3.5-mini's; 256: Gemma 3's
constexpr int64_t MAX_GROUP = 16;

// The sum of v's LANES elements, halving the lanes each time: a tree the compiler turns into a few
// vector shuffles, where a running sum is LANES dependent additions (floats are not reassociated).
inline float sum_lanes(float* v) {
  for (int64_t width = LANES / 2; width > 0; width /= 2) {
    for (int64_t lane = 0; lane < width; ++lane) v[lane] += v[lane + width];
  }
  return v[0];
}

// x and y each hold the partial sums of LANES / W positions, a segment of W lanes a position; z gets the same
// positions' sums in segments of W / 2 lanes, x's first: each segment's two halves added, as sum_lanes adds them.
template <int64_t W>
inline void fold_pair(const float* x, const float* y, float* z) {
  for (int64_t s = 0; s < LANES / W; ++s) {
    for (int64_t j = 0; j < W / 2; ++j) {
      z[s * W / 2 + j] = x[s * W + j] + x[s * W + W / 2 + j];
      z[LANES / 2 + s * W / 2 + j] = y[s * W + j] + y[s * W + W / 2 + j];
    }
  }
}

// partial holds W vectors of LANES lanes, a position's partial sums in each segment of W lanes; folds them
// in place to W / 2 vectors, the same positions' in segments of W / 2.
template <int64_t W>
inline void fold_level(float* partial) {
  for (int64_t i = 0; i < W / 2; ++i) {
    float z[LANES];
    fold_pair<W>(partial + 2 * i * LANES, partial + (2 * i + 1) * LANES, z);
    std::memcpy(partial + i * LANES, z, sizeof z);
  }
}

// partial: LANES positions' partial sums, LANES lanes each; folds them in place to their LANES sums, in
// order, the same numbers as sum_lanes of each. Summing one position's lanes is a chain of shuffles for
// each position; folding pairs of positions together shares each shuffle between them.
inline void sum_positions(float* partial) {
  static_assert(LANES == 16);
  fold_level<16>(partial);
  fold_level<8>(partial);
  fold_level<4>(partial);
  fold_level<2>(partial);
}

// How far ahead of the key or value row being read attention asks the memory for the next ones' lines. A long
// span's keys and values are read once a step, in order, layer after layer: tens of MB at a few thousand
// positions, beyond the caches, which the hardware's prefetcher alone read at half the memory's rate.
constexpr int64_t PREFETCH_BYTES = 2048;

// Asks the memory for the lines of `bytes` from PREFETCH_BYTES past `from`.
inline void prefetch_ahead(const void* from, int64_t bytes) {
  const char* ahead = static_cast<const char*>(from) + PREFETCH_BYTES;
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
}

// A key or value row as float, asking for the row PREFETCH_BYTES ahead.
template <int64_t D, typename C>
inline void load_row(const C* from, float* row) {
  prefetch_ahead(from, D * static_cast<int64_t>(sizeof(C)));
  for (int64_t e = 0; e < D; ++e) row[e] = static_cast<float>(from[e]);
}

// q . k's LANES partial sums for each of G query heads (q: [G, D]) and one key row.
template <int64_t D, int64_t G>
inline void partial_scores(const float* q, const float* row, float (*partial)[LANES]) {
  for (int64_t g = 0; g < G; ++g) {
    float p[LANES] = {};
    for (int64_t e = 0; e < D; e += LANES) {
      for (int64_t lane = 0; lane < LANES; ++lane) p[lane] += q[g * D + e + lane] * row[e + lane];
    }
    std::memcpy(partial[g], p, sizeof p);
  }
}

// scores[g * length + t] = q[g] . k[t] for G query heads over keys 0..length-1 ([length, D]), LANES
// positions at a time.
template <int64_t D, int64_t G, typename C>
void group_scores(const float* q, const C* k, int64_t length, float* scores) {
  int64_t first = 0;
  for (; first + LANES <= length; first += LANES) {
    alignas(64) float partial[G][LANES][LANES];  // [head][position][lane]
    for (int64_t t = 0; t < LANES; ++t) {
      alignas(64) float row[D];
      load_row<D>(k + (first + t) * D, row);
      alignas(64) float of_row[G][LANES];
      partial_scores<D, G>(q, row, of_row);
      for (int64_t g = 0; g < G; ++g) std::memcpy(partial[g][t], of_row[g], sizeof of_row[g]);
    }
    for (int64_t g = 0; g < G; ++g) {
      sum_positions(partial[g][0]);
      std::memcpy(scores + g * length + first, partial[g][0], LANES * sizeof(float));
    }
  }
  for (int64_t t = first; t < length; ++t) {
    alignas(64) float row[D];
    load_row<D>(k + t * D, row);
    alignas(64) float of_row[G][LANES];
    partial_scores<D, G>(q, row, of_row);
    for (int64_t g = 0; g < G; ++g) scores[g * length + t] = sum_lanes(of_row[g]);
  }
}

#ifdef ATTENTION_BF16_DOTS
// The sums of 16 vectors' lanes, one a lane: in[4 (t % 4) + t / 4]'s in lane t. Halving in steps as sum_lanes
// does, each step two vectors' sums into one (a 256-bit half of each, then a 128-bit quarter, then pairs
// within the quarters): 15 additions and 30 shuffles for 16 sums.
inline __m512 sum_each(__m512 in[16]) {
  for (int64_t i = 0; i < 8; ++i) {  // lanes 0-7: in[2i]'s halves added; 8-15: in[2i + 1]'s
    const __m512 a = in[2 * i], b = in[2 * i + 1];
    in[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int64_t i = 0; i < 4; ++i) {  // quarter q: a position's 4 partial sums
    const __m512 a = in[2 * i], b = in[2 * i + 1];
    in[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int64_t i = 0; i < 2; ++i) {  // each quarter: two positions' 2 partial sums
    const __m512 a = in[2 * i], b = in[2 * i + 1];
    in[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(in[0], in[1], 0x88), _mm512_shuffle_ps(in[0], in[1], 0xDD));
}

// q . k for 32 * VECTORS bfloat16 values each: 16 lanes of partial sums, each lane two products of q's and
// k's own values, exact, added in float.
template <int64_t VECTORS>
inline __m512 dot_lanes(const __m512bh* q, const BFloat16* k) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t v = 0; v < VECTORS; ++v) sum = _mm512_dpbf16_ps(sum, q[v], (__m512bh)_mm512_loadu_si512(k + 32 * v));
  return sum;
}

// As group_scores, for bfloat16 queries and keys: scores[g * length + t] = scaling * (q[g] . k[t]). A key
// row is never converted to float, which was half of the scores pass's work; q is unscaled (scaled, it
// would be rounded again to bfloat16), and the sums are scaled instead.
template <int64_t D, int64_t G>
void group_scores_by_dots(const BFloat16* q, float scaling, const BFloat16* k, int64_t length, float* scores) {
  constexpr int64_t VECTORS = D / 32;  // of 32 bfloat16 values a row
  __m512bh qv[G][VECTORS];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t v = 0; v < VECTORS; ++v) qv[g][v] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * v);
  }
  const __m512 scale = _mm512_set1_ps(scaling);
  int64_t first = 0;
  for (; first + LANES <= length; first += LANES) {
    prefetch_ahead(k + first * D, LANES * D * 2);
    // Head after head over the block's 16 rows, which stay in the first-level cache: one head's 16 sums
    // are 16 registers.
    for (int64_t g = 0; g < G; ++g) {
      __m512 partial[LANES];
      for (int64_t t = 0; t < LANES; ++t) partial[4 * (t % 4) + t / 4] = dot_lanes<VECTORS>(qv[g], k + (first + t) * D);
      _mm512_storeu_ps(scores + g * length + first, _mm512_mul_ps(sum_each(partial), scale));
    }
  }
  for (int64_t t = first; t < length; ++t) {
    for (int64_t g = 0; g < G; ++g) scores[g * length + t] = _mm512_reduce_add_ps(dot_lanes<VECTORS>(qv[g], k + t * D)) * scaling;
  }
}
#endif

// A row's largest value, and whether it holds a NaN (which std::max skips), in one pass the compiler
// vectorizes (std::max_element is a chain of compares and branches): the draws' first look at a row of
// logits, and attention's at a row of scores.
std::pair<float, bool> largest_of(const float* row, int64_t count) {
  float largest[LANES];
  int32_t nan[LANES] = {};
  std::fill(largest, largest + LANES, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + LANES <= count; i += LANES) {
    for (int64_t lane = 0; lane < LANES; ++lane) {
      largest[lane] = std::max(largest[lane], row[i + lane]);
      nan[lane] |= row[i + lane] != row[i + lane];
    }
  }
  for (; i < count; ++i) {
    largest[0] = std::max(largest[0], row[i]);
    nan[0] |= row[i] != row[i];
  }
  return {*std::max_element(largest, largest + LANES),
          std::any_of(nan, nan + LANES, [](int32_t any) { return any != 0; })};
}

// Each of G score rows of `length` turned into e^(score - its largest), in place; gives their largest and
// sums.
template <int64_t G>
void exponentiate(float* scores, int64_t length, float* largests, float* sums) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * length;
    // A NaN score makes its row's every output NaN either way (through its sum): left out of the largest.
    const float largest = largests[g] = largest_of(s, length).first;
    float partial[LANES] = {};
    int64_t t = 0;
    for (; t + LANES <= length; t += LANES) {
      for (int64_t lane = 0; lane < LANES; ++lane) {
        s[t + lane] = vector_exp(s[t + lane] - largest);
        partial[lane] += s[t + lane];
      }
    }
    for (; t < length; ++t) {
      s[t] = vector_exp(s[t] - largest);
      partial[0] += s[t];
    }
    sums[g] = sum_lanes(partial);
  }
}

// What attending over a part of a span leaves for each query head: its values' sum weighted by
// e^(score - largest), the largest score, and the weights' sum. Parts' are joined by `join_parts`; a whole
// span's output is sum / weights.
struct Attended {
  float* sum;  // [heads, D]
  float* largest;  // [heads]
  float* weights;  // [heads]
};

#ifdef ATTENTION_AVX512
// sum[g] = the sum over t of scores[g * length + t] * v[t] for G heads, bfloat16 values ([length, D]): the same
// products and sums, in the same order, as the loop in float; written for 512-bit vectors, where the compiler
// takes 256 (half the instructions, and the conversion to float a shift).
template <int64_t D, int64_t G>
void weighted_values(const float* scores, int64_t length, const BFloat16* v, float* sum) {
  constexpr int64_t VECTORS = D / 16;
  __m512 acc[G][VECTORS];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t u = 0; u < VECTORS; ++u) acc[g][u] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < length; ++t) {
    const BFloat16* row = v + t * D;
    prefetch_ahead(row, D * 2);
    __m512 values[VECTORS];
    for (int64_t u = 0; u < VECTORS; ++u) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * u));
      values[u] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(scores[g * length + t]);
      for (int64_t u = 0; u < VECTORS; ++u) acc[g][u] = _mm512_fmadd_ps(weight, values[u], acc[g][u]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t u = 0; u < VECTORS; ++u) _mm512_storeu_ps(sum + g * D + 16 * u, acc[g][u]);
  }
}

// vector_exp of 16 lanes at once, by the same operations in the same order: the same numbers.
inline __m512 exp_lanes(__m512 x) {
  const __m512 low = _mm512_set1_ps(-87.3f);
  // std::max(x, low) and std::min(that, 88.7f) as written, which keep a NaN: max_ps and min_ps give their
  // second operand where either is NaN, and where both are equal.
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(low, x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), clamped);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512 whole = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(clamped, clamped, _CMP_EQ_OQ), n);  // NaN's: 0
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), e, _mm512_setzero_ps());
}

// As exponentiate, 16 lanes a vector: the same numbers (each row's largest the same whatever the order it is
// found in, its sums in the same lanes and order).
template <int64_t G>
void exponentiate_lanes(float* scores, int64_t length, float* largests, float* sums) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * length;
    __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + LANES <= length; t += LANES) most = _mm512_max_ps(_mm512_loadu_ps(s + t), most);  // NaN skipped
    float largest = _mm512_reduce_max_ps(most);
    for (; t < length; ++t) largest = std::max(largest, s[t]);
    largests[g] = largest;
    const __m512 shift = _mm512_set1_ps(largest);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + LANES <= length; t += LANES) {
      const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    float partial[LANES];
    _mm512_storeu_ps(partial, sum);
    for (; t < length; ++t) {
      s[t] = vector_exp(s[t] - largest);
      partial[0] += s[t];
    }
    sums[g] = sum_lanes(partial);
  }
}
#endif

// A task's query heads, [heads, D]: scaled, as float; and as the query holds them, with the scaling, for dot
// products of the cache's own type. `softcap`: Gemma 2's cap of the scores (0: none).
template <typename C>
struct Queries {
  const float* scaled;
  const C* own;
  float scaling;
  float softcap;
};

// Scores soft-capped, in place: cap * tanh(score / cap), transformers' order of operations (Gemma 2's
// attention: its scaled scores, before the mask).
void soft_cap(float* scores, int64_t count, float cap) {
  for (int64_t i = 0; i < count; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
}

// Whether attention over a cache of C takes its scores by bfloat16 dot products: where the CPU has them,
// unless the caller asks for the loop in float alone (decode_attention_in_float, for tests).
template <typename C>
constexpr bool scores_by_dots(bool dots) {
#ifdef ATTENTION_BF16_DOTS
  return dots && std::is_same_v<C, BFloat16>;
#else
  return false;
#endif
}

// The scores of G query heads over keys 0..length-1, [G, length]: by dot products, or in float.
template <int64_t D, int64_t G, bool DOTS, typename C>
void scores_of(Queries<C> q, const C* k, int64_t length, float* scores) {
#ifdef ATTENTION_BF16_DOTS
  if constexpr (scores_by_dots<C>(DOTS)) return group_scores_by_dots<D, G>(q.own, q.scaling, k, length, scores);
#endif
  group_scores<D, G>(q.scaled, k, length, scores);
}

// G query heads of one KV head over positions 0..length-1 of its keys and values ([length, D] each); scores
// is room for [G, length]. Each key and value row is read (and the values converted to float) once for the G
// heads, which are a template argument so that their running sums stay in registers.
template <int64_t D, int64_t G, bool DOTS, typename C>
void attend_heads(Queries<C> q, const C* k, const C* v, int64_t length, float* scores, Attended to) {
  scores_of<D, G, DOTS>(q, k, length, scores);
  if (q.softcap > 0) soft_cap(scores, G * length, q.softcap);
#ifdef ATTENTION_AVX512
  exponentiate_lanes<G>(scores, length, to.largest, to.weights);
  if constexpr (std::is_same_v<C, BFloat16>) return weighted_values<D, G>(scores, length, v, to.sum);
#else
  exponentiate<G>(scores, length, to.largest, to.weights);
#endif
  alignas(64) float acc[G * D] = {};
  for (int64_t t = 0; t < length; ++t) {
    alignas(64) float row[D];
    load_row<D>(v + t * D, row);
    for (int64_t g = 0; g < G; ++g) {
      const float weight = scores[g * length + t];
      for (int64_t e = 0; e < D; ++e) acc[g * D + e] += weight * row[e];
    }
  }
  std::memcpy(to.sum, acc, sizeof acc);
}

// The query heads one KV head serves (its group) are taken up to MAX_HEADS_AT_ONCE at a time (nearly every
// model's whole group: 1 to 8), so each of their keys and values is read once, or twice for a group of 9
// to 16.
constexpr int64_t MAX_HEADS_AT_ONCE = 8;

template <int64_t D, bool DOTS, typename C>
void attend(Queries<C> q, const C* k, const C* v, int64_t length, int64_t heads, float* scores, Attended to) {
  switch (heads) {
    case 1: return attend_heads<D, 1, DOTS>(q, k, v, length, scores, to);
    case 2: return attend_heads<D, 2, DOTS>(q, k, v, length, scores, to);
    case 3: return attend_heads<D, 3, DOTS>(q, k, v, length, scores, to);
    case 4: return attend_heads<D, 4, DOTS>(q, k, v, length, scores, to);
    case 5: return attend_heads<D, 5, DOTS>(q, k, v, length, scores, to);
    case 6: return attend_heads<D, 6, DOTS>(q, k, v, length, scores, to);
    case 7: return attend_heads<D, 7, DOTS>(q, k, v, length, scores, to);
    default: return attend_heads<D, 8, DOTS>(q, k, v, length, scores, to);
  }
}

// Spans longer than this are attended in parts of at most this many positions, as even as can be, each its
// own task, and the parts joined: else one row's handful of KV heads keeps as many threads busy, and the
// rest idle, for a long step (one row of SmolLM2's 3 KV heads on 2 threads: one thread had 2 heads, the
// other 1). A part's length depends on its span alone, so a row's numbers do not change with the rows
// beside it.
constexpr int64_t SPAN_PART = 512;

// One piece of a step's attention: a query's heads from `head` on (up to MAX_HEADS_AT_ONCE, all of one KV
// head), over positions start..start + length - 1 of that head's keys and values.
struct AttentionTask {
  int64_t query, kv_head, head, heads, start, length;
  int64_t part, parts;  // which of its span's parts, of how many: a span's only part goes to the output at once
  int64_t partial;      // else where its Attended go in the parts' room, in floats
};

// The tasks of a step, each span's parts one after another; `room` gets the floats the parts need.
std::vector<AttentionTask> attention_tasks(int64_t queries, int64_t kv_heads, int64_t group, int64_t D,
                                           const int64_t* position_of, int64_t window, int64_t* room) {
  std::vector<AttentionTask> tasks;
  *room = 0;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, position_of[i] - window + 1) : 0;
    const int64_t length = position_of[i] + 1 - start;
    // Parts as even as can be (513 positions are 257 and 256), counted again from their length so that
    // none is empty.
    const int64_t fewest = (length + SPAN_PART - 1) / SPAN_PART;
    const int64_t part_length = (length + fewest - 1) / fewest;
    const int64_t parts = (length + part_length - 1) / part_length;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t head = h * group; head < (h + 1) * group; head += MAX_HEADS_AT_ONCE) {
        const int64_t heads = std::min(MAX_HEADS_AT_ONCE, (h + 1) * group - head);
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t from = start + part * part_length;
          tasks.push_back({i, h, head, heads, from, std::min(part_length, length - part * part_length), part, parts, *room});
          if (parts > 1) *room += heads * (D + 2);
        }
      }
    }
  }
  return tasks;
}

// The parts of one span (`count` tasks' Attended in a row, `heads` heads of D each) joined into its output:
// each part's sums scaled by e^(its largest - the largest of all). With `sinks` (each of the heads' sink
// logit, gpt-oss's), each head's sink is one more logit in the softmax's sum and none in the output: it
// takes a share of the attention and gives nothing back. Without, the sums are as they were to the bit
// (a sink of -inf adds e^-inf = 0).
template <int64_t D, typename C>
void join_parts(const float* partial, int64_t count, int64_t heads, const float* sinks, C* out) {
  const int64_t stride = heads * (D + 2);
  for (int64_t g = 0; g < heads; ++g) {
    const float sink = sinks != nullptr ? sinks[g] : -std::numeric_limits<float>::infinity();
    float largest = sink;
    for (int64_t p = 0; p < count; ++p) largest = std::max(largest, partial[p * stride + heads * D + g]);
    float acc[D] = {}, weights = std::exp(sink - largest);
    for (int64_t p = 0; p < count; ++p) {
      const float* part = partial + p * stride;
      const float scale = std::exp(part[heads * D + g] - largest);
      weights += part[heads * D + heads + g] * scale;
      for (int64_t e = 0; e < D; ++e) acc[e] += part[g * D + e] * scale;
    }
    for (int64_t e = 0; e < D; ++e) out[g * D + e] = static_cast<C>(acc[e] / weights);
  }
}

// Each decode query over its own row of the cache, positions 0..its own (with a window of W > 0, its last W
// of them: position - W + 1..position, as a sliding-window layer reads): [queries, heads, head_dim] in the
// cache's dtype. Query heads are grouped by the KV head they read (grouped-query attention). `sinks`: each
// query head's sink logit (join_parts), or none; `softcap`: the scores' cap (soft_cap), or 0 for none.
template <int64_t D, bool DOTS>
at::Tensor decode_attention_of(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                               const int64_t* row_of, const int64_t* position_of, double scaling, int64_t window,
                               const float* sinks, double softcap) {
  const int64_t kv_heads = keys.size(1), max_seq_len = keys.size(2);
  const int64_t queries = query.size(0), heads = query.size(1), group = heads / kv_heads;
  at::Tensor out = at::empty_like(query);
  int64_t room = 0;
  const std::vector<AttentionTask> tasks = attention_tasks(queries, kv_heads, group, D, position_of, window, &room);
  std::vector<float> parts(room);
  with_float_type(keys.scalar_type(), "the cache", [&](auto* type) {
    using C = std::remove_pointer_t<decltype(type)>;
    const C* qp = query.data_ptr<C>();
    const C* kp = keys.data_ptr<C>();
    const C* vp = values.data_ptr<C>();
    C* op = out.data_ptr<C>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      alignas(64) float q[MAX_HEADS_AT_ONCE * D];
      alignas(64) float whole[MAX_HEADS_AT_ONCE * (D + 2)];
      for (int64_t n = begin; n < end; ++n) {
        const AttentionTask& task = tasks[n];
        const int64_t at = ((row_of[task.query] * kv_heads + task.kv_head) * max_seq_len + task.start) * D;
        const int64_t first = (task.query * heads + task.head) * D;  // the task's first query head
        if constexpr (!scores_by_dots<C>(DOTS)) {
          for (int64_t j = 0; j < task.heads * D; ++j) q[j] = static_cast<float>(qp[first + j]) * static_cast<float>(scaling);
        }
        scores.resize(task.heads * task.length);
        float* room_of = task.parts == 1 ? whole : parts.data() + task.partial;
        const Attended to{room_of, room_of + task.heads * D, room_of + task.heads * (D + 1)};
        const Queries<C> of_task{q, qp + first, static_cast<float>(scaling), static_cast<float>(softcap)};
        attend<D, DOTS>(of_task, kp + at, vp + at, task.length, task.heads, scores.data(), to);
        const float* task_sinks = sinks != nullptr ? sinks + task.head : nullptr;
        if (task.parts == 1) join_parts<D>(whole, 1, task.heads, task_sinks, op + first);  // sum / weights
      }
    });
    std::vector<const AttentionTask*> in_parts;  // each span in parts, by its first
    for (const AttentionTask& task : tasks) {
      if (task.parts > 1 && task.part == 0) in_parts.push_back(&task);
    }
    at::parallel_for(0, static_cast<int64_t>(in_parts.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const AttentionTask& task = *in_parts[s];
        const float* task_sinks = sinks != nullptr ? sinks + task.head : nullptr;
        join_parts<D>(parts.data() + task.partial, task.parts, task.heads, task_sinks,
                      op + (task.query * heads + task.head) * D);
      }
    });
  });
  return out;
}

bool attention_supports(int64_t head_dim, int64_t group) {
  return group <= MAX_GROUP && std::find(std::begin(HEAD_DIMS), std::end(HEAD_DIMS), head_dim) != std::end(HEAD_DIMS);
}

// decode_attention, by bfloat16 dot products (`dots`, where the CPU has them) or in float alone.
at::Tensor decode_attention_by(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& rows, const at::Tensor& positions, double scaling, int64_t window,
                               const std::optional<at::Tensor>& sinks, double softcap, bool dots) {
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&keys, "keys"}, {&values, "values"}, {&rows, "rows"},
                                {&positions, "positions"}}) {
    check_cpu_contiguous(*t, name);
  }
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(), "keys and values must be [rows, kv_heads, max_seq_len, head_dim]");
  const int64_t cache_rows = keys.size(0), kv_heads = keys.size(1), max_seq_len = keys.size(2), head_dim = keys.size(3);
  TORCH_CHECK(kv_heads > 0, "keys and values must have at least one KV head");  // query heads are divided by them
  TORCH_CHECK(query.dim() == 3 && query.size(2) == head_dim && query.size(1) % kv_heads == 0,
              "query must be [queries, heads, head_dim], heads a multiple of the KV heads");
  TORCH_CHECK(attention_supports(head_dim, query.size(1) / kv_heads), "no loop for head size ", head_dim,
              " and ", query.size(1) / kv_heads, " query heads a KV head");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && values.scalar_type() == keys.scalar_type(),
              "query, keys and values must have one dtype");
  const int64_t queries = query.size(0);
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && rows.numel() == queries &&
                  positions.numel() == queries,
              "rows and positions must be int64, one a query");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* position_of = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < queries; ++i) {
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < cache_rows && position_of[i] >= 0 && position_of[i] < max_seq_len,
                "query ", i, " reads row ", row_of[i], " to position ", position_of[i], ", outside the cache");
  }
  if (sinks.has_value()) {
    check_cpu_contiguous(*sinks, "sinks");
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == query.size(1),
                "sinks must be float32, one a query head");
  }
  const float* sink_of = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive, not ", softcap);
  const auto of = [&](auto size, auto by_dots) {
    return decode_attention_of<decltype(size)::value, decltype(by_dots)::value>(
        query, keys, values, row_of, position_of, scaling, window, sink_of, softcap);
  };
  const auto sized = [&](auto by_dots) {
    if (head_dim == 64) return of(std::integral_constant<int64_t, 64>{}, by_dots);
    if (head_dim == 96) return of(std::integral_constant<int64_t, 96>{}, by_dots);
    if (head_dim == 128) return of(std::integral_constant<int64_t, 128>{}, by_dots);
    return of(std::integral_constant<int64_t, 256>{}, by_dots);
  };
  return dots ? sized(std::true_type{}) : sized(std::false_type{});
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rows, const at::Tensor& positions, double scaling, int64_t window,
                            const std::optional<at::Tensor>& sinks, double softcap) {
  return decode_attention_by(query, keys, values, rows, positions, scaling, window, sinks, softcap, true);
}

at::Tensor decode_attention_in_float(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                     const at::Tensor& rows, const at::Tensor& positions, double scaling,
                                     int64_t window, const std::optional<at::Tensor>& sinks, double softcap) {
  return decode_attention_by(query, keys, values, rows, positions, scaling, window, sinks, softcap, false);
}

// Whether decode_attention takes a bfloat16 cache's scores by dot products here (AVX-512 BF16).
bool attention_by_dots() {
#ifdef ATTENTION_BF16_DOTS
  return true;
#else
  return false;
#endif
}

// The sampler's counter-based randomness (backend/layers/sampler.py, row_keys and gumbel_noise), the same
// bits: Vigna's splitmix64 finalizer, Wellons' lowbias32, and the Gumbel noise -log(-log(u)) of a 23-bit
// uniform u.
uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint32_t lowbias32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x7FEB352Du;
  x = (x ^ (x >> 15)) * 0x846CA68Bu;
  return x ^ (x >> 16);
}

// The uniform number in (0, 1) the noise of token `token` is made of: 23 hashed bits and a half.
inline float uniform(uint32_t key, uint32_t token) {
  return (static_cast<float>(lowbias32(key ^ token) >> 9) + 0.5f) / 8388608.f;
}

float gumbel_noise(uint32_t key, uint32_t token) { return -std::log(-std::log(uniform(key, token))); }

// Tokens this far below a row's best logit are left out of the first look for its nucleus: together
// they hold at most vocab * e^-16 of the probability (0.5% over 49,152 tokens), and the look is
// widened to the whole row whenever what it holds falls short of top_p, so the cut stays exact.
constexpr float NUCLEUS_LOOK = 16.f;
// nucleus_draw's token for a row whose logits hold a NaN or a +inf (sampler.py: NOT_FINITE).
constexpr int64_t NOT_FINITE = -1;
// The looked-at logits are counted into this many buckets of equal width, best first: the nucleus takes
// whole buckets while what they hold stays under top_p, and only the bucket where it ends is ranked.
constexpr int64_t NUCLEUS_BUCKETS = 1024;

// The least logit of a row's nucleus: its best tokens, best first, while the probability ranked above each
// is under top_p (a tie stays or goes whole: the probability above a tie is what is above its first
// token, sampler.py's probability_above). `lowest`: the least logit looked at; `best` and `mass` (the sum
// of e^(logit - best)) the row's. NONE where the nucleus is empty (top_p 0).
float nucleus_floor(const float* logits, int64_t vocab, float top_p, float best, float lowest, float mass) {
  constexpr float NONE = -std::numeric_limits<float>::infinity();
  const float width = best - lowest;
  const float per_logit = width > 0.f && std::isfinite(width) ? NUCLEUS_BUCKETS / width : 0.f;
  // Each token's bucket (NUCLEUS_BUCKETS where it is not looked at) and weight, in one branch-free pass
  // the compiler vectorizes; then the buckets' sums in token order, and a bucket's tokens found by its
  // number. Computing the bucket and the exponential token by token, twice for a bucket's tokens, took
  // most of a flat row's draw.
  thread_local std::vector<int32_t> bucket_of_token;
  thread_local std::vector<float> weight_of_token;
  bucket_of_token.resize(vocab);
  weight_of_token.resize(vocab);
  int32_t* bucket_of = bucket_of_token.data();
  float* weight = weight_of_token.data();
  for (int64_t token = 0; token < vocab; ++token) {
    const float logit = logits[token];
    const bool looked_at = logit >= lowest && logit > NONE;
    const float place = looked_at ? (best - logit) * per_logit : 0.f;
    bucket_of[token] =
        looked_at ? std::min<int32_t>(NUCLEUS_BUCKETS - 1, static_cast<int32_t>(place)) : NUCLEUS_BUCKETS;
    weight[token] = vector_exp(logit - best);
  }
  std::vector<float> held(NUCLEUS_BUCKETS, 0.f);
  std::vector<int64_t> tokens(NUCLEUS_BUCKETS, 0);
  for (int64_t token = 0; token < vocab; ++token) {
    if (bucket_of[token] == NUCLEUS_BUCKETS) continue;
    held[bucket_of[token]] += weight[token];
    ++tokens[bucket_of[token]];
  }
  // Whole buckets while the probability above each of their tokens is surely under top_p.
  const float cut = top_p * mass;
  float above = 0.f;
  int64_t bucket = 0;
  while (bucket < NUCLEUS_BUCKETS && above + held[bucket] < cut) above += held[bucket++];
  // Then the tokens of the next buckets, ranked as (logit, -token), until the cut: a bucket's first token
  // is past the last one's logit, so the nucleus ends there once what it holds reaches top_p.
  float floor = bucket == NUCLEUS_BUCKETS ? lowest : NONE, previous = NONE;
  std::vector<std::pair<float, int64_t>> ranked;
  for (; bucket < NUCLEUS_BUCKETS && above < cut; ++bucket) {
    if (tokens[bucket] == 0) continue;
    ranked.clear();
    for (int64_t token = 0; token < vocab; ++token) {
      if (bucket_of[token] == bucket) ranked.emplace_back(logits[token], -token);
    }
    std::sort(ranked.begin(), ranked.end(), std::greater<>());
    for (const auto& [logit, token] : ranked) {
      if (logit != previous && above >= cut) return floor;
      previous = floor = logit;
      above += weight[-token];
    }
  }
  return floor;
}

// The least 1 - u a token's noise is made of (`uniform`'s largest u is 1 - 2^-24), so its noise is at most
// -log of it, 16.64: a token whose logit is further than that below the winner's value cannot win.
constexpr float LEAST_BEYOND = 0.5f / 8388608.f;
// Tokens the race checks at once: its checks are branch-free, so that the compiler vectorizes them, and a
// chunk only where one of its tokens passes is looked at token by token.
constexpr int64_t RACE_CHUNK = 64;

// The Gumbel race among the tokens whose logit is at least `least` (a nucleus's floor; -inf for the whole
// vocabulary), from token `first`, the best (the lowest id of a tie): the winner is the greatest logit +
// noise, and of equal ones the greater logit, then the lower token, as a heap of the candidates would
// meet them. It skips the tokens that cannot win: the noise -log(-log u) is at most -log(1 - u) (since
// -log u >= 1 - u), so a token with 1 - u > e^(logit - winner) cannot beat the winner so far (tested with
// a margin of a nat and more, for rounding), and a chunk whose logits all lie too far below for any u to
// pass is skipped unhashed. Only the tokens let through draw their noise, two logarithms each: a flat
// row races a handful of its tokens in full.
int64_t race_from(const float* logits, int64_t vocab, uint32_t key, float least, int64_t first) {
  int64_t chosen = first;
  float chosen_logit = logits[first], winner = chosen_logit + gumbel_noise(key, static_cast<uint32_t>(first));
  // A token can win only where 1 - u <= e^(logit - reach); none below `floor`, whatever its u.
  float reach = 0.f, floor = 0.f;
  const auto raise = [&] {
    reach = winner - 1.f - 1e-6f * std::abs(winner);
    floor = std::max(least, reach + std::log(LEAST_BEYOND));
  };
  raise();
  const auto may_race = [&](int64_t token) {
    const float logit = logits[token];
    if (!(logit >= least) || token == chosen ||
        1.f - uniform(key, static_cast<uint32_t>(token)) > vector_exp(logit - reach)) {
      return;
    }
    const float raced = logit + gumbel_noise(key, static_cast<uint32_t>(token));
    if (raced > winner || (raced == winner && (logit > chosen_logit || (logit == chosen_logit && token < chosen)))) {
      winner = raced;
      chosen = token;
      chosen_logit = logit;
      raise();
    }
  };
  int64_t i = 0;
  for (; i + RACE_CHUNK <= vocab; i += RACE_CHUNK) {
    int32_t near = 0, through = 0;
    for (int64_t lane = 0; lane < RACE_CHUNK; ++lane) near |= logits[i + lane] >= floor;
    if (!near) continue;
    for (int64_t lane = 0; lane < RACE_CHUNK; ++lane) {
      through |= 1.f - uniform(key, static_cast<uint32_t>(i + lane)) <= vector_exp(logits[i + lane] - reach);
    }
    if (!through) continue;
    for (int64_t token = i; token < i + RACE_CHUNK; ++token) may_race(token);
  }
  for (; i < vocab; ++i) may_race(i);
  return chosen;
}

// One row's draw from its whole vocabulary (sampler.py's race with no cut: top_p 1 and no top_k, what
// OpenAI's API asks by default): `race_from` the best token, over every token, where PyTorch's race hashes
// every token and takes two logarithms of each.
int64_t race_draw_row(const float* logits, int64_t vocab, uint32_t key) {
  constexpr float NONE = -std::numeric_limits<float>::infinity();
  const auto [best, nan] = largest_of(logits, vocab);
  if (nan || best == std::numeric_limits<float>::infinity()) return NOT_FINITE;
  if (!(best > NONE)) return 0;  // every token -inf: what the race over them gives
  return race_from(logits, vocab, key, NONE, std::find(logits, logits + vocab, best) - logits);
}

// One row's draw (sampler.py: nucleus_cut, then race): among the row's nucleus (`nucleus_floor`), the
// Gumbel race, the noise of token t hashed from (key, t). Both as sampler.py has them, so that a seed
// draws the same token here as by PyTorch (a GPU, a machine without a compiler), where torch.topk orders
// tied tokens another way: the noise goes by token id, not by place, and a tie stays or goes whole.
//
// A flat row's nucleus is most of the vocabulary (a random-weight model's: some 47,000 of 49,152 tokens),
// and its noise two logarithms a token: 76 ms of a 32-row step where a heap ranked the whole nucleus
// (docs/performance.md). So the nucleus is found by buckets, and the race (`race_from`) skips the tokens
// that cannot win.
int64_t nucleus_draw_row(const float* logits, int64_t vocab, float top_p, uint32_t key) {
  constexpr float NONE = -std::numeric_limits<float>::infinity();
  const auto [best, nan] = largest_of(logits, vocab);
  if (nan || best == std::numeric_limits<float>::infinity()) return NOT_FINITE;
  if (!(best > NONE)) return 0;  // nothing left to draw from: what the race over -inf gives
  // The row's probability mass (unnormalized, the best token's 1), and that of the first look.
  float lowest = best - NUCLEUS_LOOK, total[LANES] = {}, looked[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= vocab; i += LANES) {
    for (int64_t lane = 0; lane < LANES; ++lane) {
      const float weight = vector_exp(logits[i + lane] - best);
      total[lane] += weight;
      looked[lane] += logits[i + lane] >= lowest ? weight : 0.f;
    }
  }
  for (; i < vocab; ++i) {
    const float weight = vector_exp(logits[i] - best);
    total[0] += weight;
    looked[0] += logits[i] >= lowest ? weight : 0.f;
  }
  const float mass = sum_lanes(total);
  if (sum_lanes(looked) < top_p * mass) {  // a flat row: its nucleus reaches further down, to the least logit
    for (int64_t token = 0; token < vocab; ++token) {
      if (logits[token] > NONE) lowest = std::min(lowest, logits[token]);
    }
  }
  const float floor = nucleus_floor(logits, vocab, top_p, best, lowest, mass);
  // The race, from the best token (the lowest id of a tie), among the nucleus.
  const int64_t first = std::find(logits, logits + vocab, best) - logits;
  if (!(floor > NONE)) return first;  // an empty nucleus (top_p 0) draws the best token
  return race_from(logits, vocab, key, floor, first);
}

// The draws' inputs: logits [rows, vocab] float32, seeds and counters int64, one a row.
void check_draw_inputs(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& counters) {
  for (const auto& [t, name] : {std::pair{&logits, "logits"}, {&seeds, "seeds"}, {&counters, "counters"}}) {
    check_cpu_contiguous(*t, name);
  }
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be float32 [rows, vocab]");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(seeds.scalar_type() == at::kLong && counters.scalar_type() == at::kLong && seeds.numel() == rows &&
                  counters.numel() == rows,
              "seeds and counters must be int64, one a row");
}

// Each row's draw by `draw_row(row, its logits, vocab, its key)`, the key hashed from the row's seed and
// counter as sampler.py's row_keys hashes it: [rows] token ids.
template <typename DrawRow>
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& counters,
                     DrawRow&& draw_row) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* cp = counters.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint64_t mixed = splitmix64(splitmix64(static_cast<uint64_t>(sp[r])) + static_cast<uint64_t>(cp[r]));
      out[r] = draw_row(r, lp + r * vocab, vocab, static_cast<uint32_t>(mixed >> 33));
    }
  });
  return tokens;
}

// Each row's draw from its nucleus: logits [rows, vocab] float32, already divided by the row's
// temperature; top_p, seeds and counters one a row. Returns [rows] token ids, those sampler.py's
// nucleus_cut and race give but for a rounding (its softmax and logarithms are PyTorch's), and
// NOT_FINITE (-1) for a row with a NaN or a +inf.
at::Tensor nucleus_draw(const at::Tensor& logits, const at::Tensor& top_p, const at::Tensor& seeds,
                        const at::Tensor& counters) {
  check_draw_inputs(logits, seeds, counters);
  check_cpu_contiguous(top_p, "top_p");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.numel() == logits.size(0), "top_p must be float32, one a row");
  const float* pp = top_p.data_ptr<float>();
  return draw_rows(logits, seeds, counters, [&](int64_t r, const float* row, int64_t vocab, uint32_t key) {
    return nucleus_draw_row(row, vocab, pp[r], key);
  });
}

// Each row's draw from its whole vocabulary: logits [rows, vocab] float32, already divided by the row's
// temperature; seeds and counters one a row. Returns [rows] token ids, those sampler.py's race gives but
// for a rounding of the noise's logarithms, and NOT_FINITE (-1) for a row with a NaN or a +inf.
at::Tensor race_draw(const at::Tensor& logits, const at::Tensor& seeds, const at::Tensor& counters) {
  check_draw_inputs(logits, seeds, counters);
  return draw_rows(logits, seeds, counters, [](int64_t, const float* row, int64_t vocab, uint32_t key) {
    return race_draw_row(row, vocab, key);
  });
}

// Each row's grammar mask on its logits, in place (grammar.py's Masks.apply): logits [rows, vocab]
// float32; bitmask [lines, words] int32, llguidance's, bit t of word w is token 32w + t, set where the token
// is allowed; lines [rows] int64, the bitmask line of each row, or -1 for a row without a grammar. A token
// whose bit is clear becomes -inf. PyTorch's operations unpacked every bit of every row into a tensor of
// their own, 2.9 ms of a 32-row step; here a word of allowed tokens is one comparison (0.03 ms).
void mask_disallowed(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& lines) {
  check_cpu_contiguous(logits, "logits");
  check_cpu_contiguous(bitmask, "bitmask");
  check_cpu_contiguous(lines, "lines");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be float32 [rows, vocab]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt, "bitmask must be int32 [lines, words]");
  TORCH_CHECK(lines.scalar_type() == at::kLong && lines.numel() == logits.size(0), "lines must be int64, one a row");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "the bitmask has ", words * 32, " bits a line, fewer than the ", vocab, " logits");
  const int64_t* line_of = lines.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(line_of[r] >= -1 && line_of[r] < bitmask.size(0), "row ", r, " names bitmask line ", line_of[r]);
  }
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr float NONE = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, rows_per_task(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (line_of[r] < 0) continue;
      float* row = lp + r * vocab;
      const uint32_t* bits = bp + line_of[r] * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t allowed = bits[w];
        if (allowed == ~0u) continue;
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
        for (int64_t t = 0; t < count; ++t) {
          if (!((allowed >> t) & 1u)) row[first + t] = NONE;
        }
      }
    }
  });
}

// Each row of x times smoothing, rounded to int8 with its own scale (largest magnitude / 127):
// returns (int8 [rows, in], float32 scales [rows, 1]).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const at::Tensor& smoothing) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(smoothing, "smoothing");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  TORCH_CHECK(smoothing.scalar_type() == at::kFloat && smoothing.numel() == x.size(1), "smoothing must be float32 [in]");
  const int64_t n = x.size(0), d = x.size(1);
  at::Tensor q = at::empty({n, d}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({n, 1}, x.options().dtype(at::kFloat));
  with_float_type(x.scalar_type(), "x", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* xp = x.data_ptr<T>();
    const float* sp = smoothing.data_ptr<float>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* scale = scales.data_ptr<float>();
    at::parallel_for(0, n, rows_per_task(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = xp + r * d;
        // std::max skips a NaN, which then went over the scale and was cast to an integer (undefined
        // behaviour; an infinity too): `poison`, 0 times each magnitude, is NaN where the row holds one,
        // and the row's scale is NaN then, so its products are, as PyTorch's are (its largest is NaN).
        float partial[LANES] = {}, poison[LANES] = {};
        int64_t i = 0;
        for (; i + LANES <= d; i += LANES) {
          for (int64_t lane = 0; lane < LANES; ++lane) {
            const float magnitude = std::abs(static_cast<float>(row[i + lane]) * sp[i + lane]);
            partial[lane] = std::max(partial[lane], magnitude);
            poison[lane] += 0.f * magnitude;
          }
        }
        float largest = 0.f, poisoned = 0.f;
        for (; i < d; ++i) {
          const float magnitude = std::abs(static_cast<float>(row[i]) * sp[i]);
          largest = std::max(largest, magnitude);
          poisoned += 0.f * magnitude;
        }
        for (int64_t lane = 0; lane < LANES; ++lane) {
          largest = std::max(largest, partial[lane]);
          poisoned += poison[lane];
        }
        int8_t* q_row = qp + r * d;
        if (poisoned != 0.f) {  // NaN
          scale[r] = std::numeric_limits<float>::quiet_NaN();
          std::fill(q_row, q_row + d, 0);
          continue;
        }
        const float row_scale = std::max(largest, std::numeric_limits<float>::min()) / 127.f;
        scale[r] = row_scale;
        for (int64_t j = 0; j < d; ++j) {  // |x / scale| <= 127: no clamp needed
          q_row[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(static_cast<float>(row[j]) * sp[j] / row_scale)));
        }
      }
    });
  });
  return {q, scales};
}

// accumulated [rows, out] int32 * row_scales [rows, 1] * weight_scales [out], in dtype.
at::Tensor scale_products(const at::Tensor& accumulated, const at::Tensor& row_scales, const at::Tensor& weight_scales,
                          at::ScalarType dtype) {
  check_cpu_contiguous(accumulated, "accumulated");
  check_cpu_contiguous(row_scales, "row_scales");
  check_cpu_contiguous(weight_scales, "weight_scales");
  TORCH_CHECK(accumulated.scalar_type() == at::kInt && accumulated.dim() == 2, "accumulated must be int32 [rows, out]");
  const int64_t n = accumulated.size(0), m = accumulated.size(1);
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == n, "row_scales must be float32 [rows, 1]");
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.numel() == m, "weight_scales must be float32 [out]");
  at::Tensor out = at::empty({n, m}, accumulated.options().dtype(dtype));
  with_float_type(dtype, "dtype", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const int32_t* ap = accumulated.data_ptr<int32_t>();
    const float* rp = row_scales.data_ptr<float>();
    const float* wp = weight_scales.data_ptr<float>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, n, rows_per_task(m), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < m; ++i) op[r * m + i] = static_cast<T>(static_cast<float>(ap[r * m + i]) * (rp[r] * wp[i]));
      }
    });
  });
  return out;
}

// One token of each decoding row through a Mamba-2 scan, the state advanced in place, in one pass over
// it: state [rows, heads, head_dim, state_size] float32; x [rows, heads, head_dim]; dt and decay
// [rows, heads] (the time step after its softplus, and exp(dt * A)); B and C [rows, heads, state_size];
// D [heads]; all float32. Each state number is s * decay + (dt * B) * x, and the output of a head's
// dimension its states times C, plus x * D. transformers' update (mamba.advance_mamba2 in PyTorch's
// operations) reads and writes the state some five times over.
at::Tensor ssm_update(at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& decay,
                      const at::Tensor& B, const at::Tensor& C, const at::Tensor& D) {
  check_cpu_float(state, "state");
  check_cpu_float(x, "x");
  check_cpu_float(dt, "dt");
  check_cpu_float(decay, "decay");
  check_cpu_float(B, "B");
  check_cpu_float(C, "C");
  check_cpu_float(D, "D");
  TORCH_CHECK(state.dim() == 4, "state must be [rows, heads, head_dim, state_size]");
  const int64_t rows = state.size(0), heads = state.size(1), head_dim = state.size(2), n = state.size(3);
  TORCH_CHECK(x.numel() == rows * heads * head_dim, "x must be [rows, heads, head_dim]");
  TORCH_CHECK(dt.numel() == rows * heads && decay.numel() == rows * heads, "dt and decay must be [rows, heads]");
  TORCH_CHECK(B.numel() == rows * heads * n && C.numel() == rows * heads * n, "B and C must be [rows, heads, state_size]");
  TORCH_CHECK(D.numel() == heads, "D must be [heads]");
  at::Tensor out = at::empty({rows, heads, head_dim}, x.options());
  float* sp = state.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = decay.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *dp = D.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> added(n);
    for (int64_t rh = begin; rh < end; ++rh) {
      const float a = ap[rh], skip = dp[rh % heads];
      const float* b = bp + rh * n;
      const float* c = cp + rh * n;
      for (int64_t k = 0; k < n; ++k) added[k] = dtp[rh] * b[k];
      for (int64_t p = 0; p < head_dim; ++p) {
        const float xv = xp[rh * head_dim + p];
        float* s = sp + (rh * head_dim + p) * n;
        float partial[LANES] = {};
        int64_t k = 0;
        for (; k + LANES <= n; k += LANES) {
          for (int64_t lane = 0; lane < LANES; ++lane) {
            const float v = s[k + lane] * a + added[k + lane] * xv;
            s[k + lane] = v;
            partial[lane] += v * c[k + lane];
          }
        }
        for (; k < n; ++k) {
          s[k] = s[k] * a + added[k] * xv;
          partial[0] += s[k] * c[k];
        }
        op[rh * head_dim + p] = sum_lanes(partial) + xv * skip;
      }
    }
  });
  return out;
}


// One token of each row through a Gated DeltaNet (model/gated_delta.py), its state in place: state [rows,
// heads, key_dim, value_dim], a matrix a head that maps keys to values; query and key [rows, heads,
// key_dim] (normed, the query scaled), value [rows, heads, value_dim], decay (exp'd) and beta [rows,
// heads]; all float32. Each head's matrix is decayed, corrected towards the value by beta times the error
// of what it gives for the key (the delta rule), then read by the query: two passes over a head's matrix
// (64 KiB at 128 x 128, in the core's cache for the second), where PyTorch's operations
// (decode_ops.EagerOps.gated_delta_update) made some eight over every row's, most of them allocating.
at::Tensor gated_delta_update(at::Tensor& state, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& decay, const at::Tensor& beta) {
  check_cpu_float(state, "state");
  check_cpu_float(query, "query");
  check_cpu_float(key, "key");
  check_cpu_float(value, "value");
  check_cpu_float(decay, "decay");
  check_cpu_float(beta, "beta");
  TORCH_CHECK(state.dim() == 4, "state must be [rows, heads, key_dim, value_dim]");
  const int64_t rows = state.size(0), heads = state.size(1), key_dim = state.size(2), value_dim = state.size(3);
  TORCH_CHECK(query.numel() == rows * heads * key_dim && key.numel() == rows * heads * key_dim,
              "query and key must be [rows, heads, key_dim]");
  TORCH_CHECK(value.numel() == rows * heads * value_dim, "value must be [rows, heads, value_dim]");
  TORCH_CHECK(decay.numel() == rows * heads && beta.numel() == rows * heads, "decay and beta must be [rows, heads]");
  at::Tensor out = at::empty({rows, heads, value_dim}, value.options());
  float* sp = state.data_ptr<float>();
  const float *qp = query.data_ptr<float>(), *kp = key.data_ptr<float>(), *vp = value.data_ptr<float>();
  const float *ap = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> predicted(value_dim), delta(value_dim);
    for (int64_t rh = begin; rh < end; ++rh) {
      const float a = ap[rh], rate = bp[rh];
      float* s = sp + rh * key_dim * value_dim;
      const float *q = qp + rh * key_dim, *k = kp + rh * key_dim, *v = vp + rh * value_dim;
      float* o = op + rh * value_dim;
      std::fill(predicted.begin(), predicted.end(), 0.f);
      for (int64_t i = 0; i < key_dim; ++i) {  // what the decayed matrix gives for the key
        const float weight = k[i] * a;
        const float* line = s + i * value_dim;
        for (int64_t j = 0; j < value_dim; ++j) predicted[j] += line[j] * weight;
      }
      for (int64_t j = 0; j < value_dim; ++j) {
        delta[j] = (v[j] - predicted[j]) * rate;
        o[j] = 0.f;
      }
      for (int64_t i = 0; i < key_dim; ++i) {  // decayed, corrected, and read by the query
        const float ki = k[i], qi = q[i];
        float* line = s + i * value_dim;
        for (int64_t j = 0; j < value_dim; ++j) {
          const float x = line[j] * a + ki * delta[j];
          line[j] = x;
          o[j] += x * qi;
        }
      }
    }
  });
  return out;
}

// One token of each query's row through a short convolution layer (LFM2's, model/short_conv.py): of its
// projection [queries, 3 * hidden] (B, C and x side by side), B * x joins the row's last inputs (`states`,
// [rows, hidden, kernel], shifted in place), their convolution with each channel's filter ([hidden, kernel])
// and bias, gated by C: [queries, hidden]. B * x, the convolution and its gating each rounded to the
// activations' dtype, as transformers' operations round them. Each query's row is its own (no two alike).
at::Tensor short_conv(at::Tensor& states, const at::Tensor& projected, const at::Tensor& rows, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  check_cpu_contiguous(states, "states");
  check_cpu_contiguous(projected, "projected");
  check_cpu_contiguous(rows, "rows");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(states.dim() == 3, "states must be [rows, hidden, kernel]");
  const int64_t hidden = states.size(1), kernel = states.size(2), queries = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong, "rows must be int64");
  TORCH_CHECK(projected.numel() == queries * 3 * hidden, "projected must be [queries, 3 * hidden]");
  TORCH_CHECK(weight.numel() == hidden * kernel, "weight must be [hidden, kernel]");
  TORCH_CHECK(projected.scalar_type() == states.scalar_type() && weight.scalar_type() == states.scalar_type(),
              "projected, states and weight must be of one dtype");
  if (bias.has_value()) {
    check_cpu_contiguous(*bias, "bias");
    TORCH_CHECK(bias->numel() == hidden && bias->scalar_type() == states.scalar_type(), "bias must be [hidden]");
  }
  at::Tensor out = at::empty({queries, hidden}, projected.options());
  with_float_type(states.scalar_type(), "states", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    T* sp = states.data_ptr<T>();
    const T *pp = projected.data_ptr<T>(), *wp = weight.data_ptr<T>();
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    const int64_t* rp = rows.data_ptr<int64_t>();
    T* op = out.data_ptr<T>();
    for (int64_t q = 0; q < queries; ++q) TORCH_CHECK(rp[q] >= 0 && rp[q] < states.size(0), "a row outside the states");
    at::parallel_for(0, queries, rows_per_task(3 * hidden), [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const T *b = pp + q * 3 * hidden, *c = b + hidden, *x = c + hidden;
        for (int64_t h = 0; h < hidden; ++h) {
          T* s = sp + (rp[q] * hidden + h) * kernel;
          const T* w = wp + h * kernel;
          std::memmove(s, s + 1, (kernel - 1) * sizeof(T));
          s[kernel - 1] = static_cast<T>(static_cast<float>(b[h]) * static_cast<float>(x[h]));
          float sum = bp != nullptr ? static_cast<float>(bp[h]) : 0.f;
          for (int64_t k = 0; k < kernel; ++k) sum += static_cast<float>(s[k]) * static_cast<float>(w[k]);
          op[q * hidden + h] = static_cast<T>(static_cast<float>(c[h]) * static_cast<float>(static_cast<T>(sum)));
        }
      }
    });
  });
  return out;
}

}  // namespace fused_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fused_ops;
  // Every loop runs without the interpreter's lock: none touches a Python object, and a step holding it
  // kept the backend's other threads (the outbox's feeder, sending the last step's tokens) waiting a whole
  // step.
  const auto released = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm of each row", released);
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta in place; the sum's RMSNorm", released);
  m.def("layer_norm", &layer_norm, "LayerNorm of each row, without a bias (Cohere's)", released);
  m.def("add_layer_norm", &add_layer_norm, "hidden += delta in place; the sum's LayerNorm", released);
  m.def("head_rms_norms", &head_rms_norms, "each query and key head's RMSNorm, in place in q, k and v", released);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [rows, 2 * width]", released);
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu(gate, tanh approximation) * up of [rows, 2 * width]", released);
  m.def("rotate_and_store", &rotate_and_store, "rotary embedding of queries and keys, keys and values into the cache", released);
  m.def("decode_attention", &decode_attention, "each decode query over its own row of the cache", released);
  m.def("decode_attention_in_float", &decode_attention_in_float,
        "decode_attention without bfloat16 dot products, as CPUs without AVX-512 BF16 run it (tests, timings)", released);
  m.def("attention_by_dots", &attention_by_dots, "whether decode_attention scores a bfloat16 cache by dot products here");
  m.def("attention_supports", &attention_supports, "whether decode_attention has a loop for this head size and group");
  m.def("nucleus_draw", &nucleus_draw, "each row's draw from its nucleus (sampler.py's nucleus_cut and race)", released);
  m.def("race_draw", &race_draw, "each row's draw from its whole vocabulary (sampler.py's race)", released);
  m.def("mask_disallowed", &mask_disallowed, "each row's grammar bitmask on its logits, in place", released);
  m.def("quantize_rows", &quantize_rows, "smoothed rows to int8, a scale a row", released);
  m.def("scale_products", &scale_products, "int32 products times row and weight scales", released);
  m.def("block_matmul_kernel", &block_matmul_kernel, "what block_matmul multiplies by here: AVX-512 VNNI, AVX2 or ''");
  m.def("block_matmul", &block_matmul, "few rows times weights in blocks of 32 (block_weights.py)", released);
  m.def("block_matmul_avx2", &block_matmul_avx2, "block_matmul by its AVX2 kernel (tests, timings)", released);
  m.def("block_dequantize", &block_dequantize, "the weights blocks hold, into a float tensor (block_weights.py)", released);
  m.def("block_rows", &block_rows, "some rows of the weights blocks hold, into a float tensor (an embedding's)", released);
  m.def("ssm_update", &ssm_update, "one token of each row through a Mamba-2 scan, its state in place", released);
  m.def("gated_delta_update", &gated_delta_update, "one token of each row through a Gated DeltaNet, its state in place", released);
  m.def("short_conv", &short_conv, "one token of each row through a short convolution layer, its state in place", released);
  // Local to this build: two builds in one process (a test's, a timing's) would each register it
  pybind11::class_<Mixture>(m, "Mixture", "how a mixture of experts routes and activates (fused_ops.h)",
                            pybind11::module_local())
      .def(pybind11::init<int64_t, bool, bool, double, double>(), pybind11::arg("top_k"), pybind11::arg("normalize"),
           pybind11::arg("top_k_first"), pybind11::arg("alpha"), pybind11::arg("limit"));
  m.def("experts_forward", &experts_forward, "a Qwen3-MoE, Mixtral or gpt-oss layer's routing and experts (quantized_experts.py)", released);
  m.def("decode_layers", &decode_layers, "a decode step's layers in one call (decoder_runner.NativeDecode)", released);
}
