// Few rows of activations times weights stored in blocks of 32 (4-bit or 8-bit, a scale each), by the CPU's
// int8 dot products (AVX-512 VNNI), as llama.cpp multiplies its Q4_1 and Q8_0 files (backend/block_weights.py
// has the layout and says why; docs/performance.md measures it).
//
// Each block of 32 activations of a row becomes 32 int8 values and a float scale (round(x / d), d =
// max|x| / 127). A block of 32 weights of an output channel is w = d_w * u + m_w with u unsigned (0..15 or
// 0..255). The product of the two blocks is then
//
//     d_w * d_x * sum(u * q_x) + m_w * d_x * sum(q_x)
//
// whose integer sum is VNNI's vpdpbusd: 64 unsigned bytes times 64 signed ones, four at a time into 16
// int32 lanes. The weights are stored so that each lane is one output channel: 16 channels side by side,
// 4 consecutive inputs of each per 32-bit lane, so the sums need no shuffling and a block's scales are
// one vector of 16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "fused_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define BLOCK_MATMUL_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;     // inputs a scale covers: GGUF's Q4_0, Q4_1 and Q8_0 blocks
constexpr int64_t CHANNELS = 16;  // output channels stored side by side, one a 32-bit lane
// Rows of activations multiplied per pass over a group's weights: each keeps one accumulator register.
constexpr int64_t ROWS_AT_ONCE = 8;
// Pieces of a product a thread takes, on average: enough that a thread that lost its core leaves little.
constexpr int64_t CHUNKS_A_THREAD = 8;

// Bytes of one block of 16 channels: their values, then their fp16 scales d (and, 4-bit, minimums m).
// 8-bit blocks have m = -128 d (u = q + 128), so they store d alone.
constexpr int64_t block_bytes(int64_t bits) { return bits == 4 ? 16 * 16 + 2 * 32 : 16 * 32 + 32; }

#ifdef BLOCK_MATMUL_VNNI

// Activations in blocks of 32: int8 values, and for each block d and d * sum(values).
struct QuantizedRows {
  std::vector<int8_t> values;  // [rows, in]
  std::vector<float> scales;   // [rows, in / 32]
  std::vector<float> sums;     // [rows, in / 32]
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / BLOCK;
  QuantizedRows out{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks)};
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const __m512 low = load16(x + b * BLOCK), high = load16(x + b * BLOCK + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, low), _mm512_andnot_ps(sign, high)));
    const float scale = largest / 127.f;
    const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
    // Rounded to nearest, ties to even (the default rounding mode), as torch.round does.
    const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
    const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values.data() + b * BLOCK), _mm512_cvtsepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values.data() + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q_high));
    out.scales[b] = scale;
    out.sums[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
  }
  return out;
}

inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(c10::BFloat16* out, __m512 v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  alignas(64) float values[CHANNELS];
  _mm512_store_ps(values, v);
  for (int64_t i = 0; i < CHANNELS; ++i) out[i] = c10::BFloat16(values[i]);  // rounded to nearest even
#endif
}

// Rows [first, first + count) of x times one group of 16 output channels, whose blocks start at `weights`.
template <int BITS, typename T>
void multiply_group(const uint8_t* weights, const QuantizedRows& x, int64_t first, int64_t count, int64_t in,
                    T* out, int64_t out_stride) {
  const int64_t blocks = in / BLOCK;
  __m512 sums[ROWS_AT_ONCE];
  for (int64_t r = 0; r < count; ++r) sums[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, weights += block_bytes(BITS)) {
    // u[j]: inputs 4j..4j+3 of the block for each of the 16 channels. 4-bit: byte i of a 64-byte line
    // holds u[2c] in its low nibble and u[2c + 1] in its high one.
    __m512i u[8];
    if constexpr (BITS == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i line = _mm512_loadu_si512(weights + 64 * c);
        u[2 * c] = _mm512_and_si512(line, nibble);
        u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(line, 4), nibble);
      }
    } else {
      for (int j = 0; j < 8; ++j) u[j] = _mm512_loadu_si512(weights + 64 * j);
    }
    const uint8_t* scales = weights + (BITS == 4 ? 256 : 512);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    const __m512 m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)))
                               : _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row_block = (first + r) * blocks + b;
      const int32_t* q = reinterpret_cast<const int32_t*>(x.values.data() + row_block * BLOCK);
      // Two chains of four, so that each product need not wait for the one before.
      __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(q[0]));
      __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], _mm512_set1_epi32(q[1]));
      for (int j = 2; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, u[j], _mm512_set1_epi32(q[j]));
        odd = _mm512_dpbusd_epi32(odd, u[j + 1], _mm512_set1_epi32(q[j + 1]));
      }
      const __m512 products = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      sums[r] = _mm512_fmadd_ps(products, _mm512_mul_ps(d, _mm512_set1_ps(x.scales[row_block])), sums[r]);
      sums[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[row_block]), sums[r]);
    }
  }
  for (int64_t r = 0; r < count; ++r) store16(out + (first + r) * out_stride, sums[r]);
}

#endif  // BLOCK_MATMUL_VNNI

}  // namespace

namespace fused_ops {

// Whether this build multiplies blocks (the CPU it was compiled for has AVX-512 VNNI).
bool block_matmul_supported() {
#ifdef BLOCK_MATMUL_VNNI
  return true;
#else
  return false;
#endif
}

// x [rows, in] (float32 or bfloat16) times weights [out, in / 32 * bytes a channel's block] (block_weights.py's
// layout) -> [rows, out] in x's dtype.
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weights, int64_t bits) {
  TORCH_CHECK(block_matmul_supported(), "block_matmul needs a CPU with AVX-512 VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, not ", bits);
  TORCH_CHECK(x.device().is_cpu() && weights.device().is_cpu(), "block_matmul runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in]");
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 2 && weights.is_contiguous(),
              "weights must be contiguous uint8 [out, in / 32 * bytes]");
  const int64_t rows = x.size(0), in = x.size(1), out = weights.size(0);
  TORCH_CHECK(in % BLOCK == 0 && out % CHANNELS == 0, "in must be a multiple of 32 and out of 16");
  TORCH_CHECK(weights.size(1) * CHANNELS == in / BLOCK * block_bytes(bits), "weights do not hold ", bits,
              "-bit blocks of ", in, " inputs");
  at::Tensor result = at::empty({rows, out}, x.options());
#ifdef BLOCK_MATMUL_VNNI
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const int64_t group_bytes = in / BLOCK * block_bytes(bits);
  auto multiply = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const QuantizedRows q = quantize_rows(x.data_ptr<T>(), rows, in);
    T* o = result.data_ptr<T>();
    auto multiply_groups = [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        for (int64_t first = 0; first < rows; first += ROWS_AT_ONCE) {
          const int64_t count = std::min(ROWS_AT_ONCE, rows - first);
          if (bits == 4) {
            multiply_group<4>(w + g * group_bytes, q, first, count, in, o + g * CHANNELS, out);
          } else {
            multiply_group<8>(w + g * group_bytes, q, first, count, in, o + g * CHANNELS, out);
          }
        }
      }
    };
    // The threads take groups a few at a time as they get to them, not half each: the server's other
    // processes take a core now and then, and a thread that lost its core would leave the other waiting
    // at the end of every product. With a process taking a fifth of a core beside the engine, 32-row steps
    // went 22% slower with halves and 12% slower this way (docs/performance.md).
    const int64_t groups = out / CHANNELS;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), groups);
    const int64_t chunk = std::max<int64_t>(1, groups / (CHUNKS_A_THREAD * threads));
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t begin; (begin = next.fetch_add(chunk)) < groups;) {
        multiply_groups(begin, std::min(begin + chunk, groups));
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    multiply(static_cast<float*>(nullptr));
  } else if (x.scalar_type() == at::kBFloat16) {
    multiply(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, "x must be float32 or bfloat16, not ", x.scalar_type());
  }
#endif
  return result;
}

}  // namespace fused_ops
