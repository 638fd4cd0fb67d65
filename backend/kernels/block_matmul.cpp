// Few rows of activations times weights stored in blocks of 32 (4 to 8 bits, a scale each), by the CPU's
// int8 dot products (AVX-512 VNNI, or AVX2), as llama.cpp multiplies its Q4_1, Q6_K and Q8_0 files (backend/quant/block_weights.py
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
//
// Symmetric blocks (GGUF's Q4_0 and Q5_0) keep d alone: w = d * (u - 2^(bits - 1)), whose m = -2^(bits - 1)
// d the kernels make from d, as they do 8-bit blocks' -128 d, so that a step reads 4.5 bits a weight, not 5.
// Symmetric 4-bit super-blocks (GGUF's Q3_K: u = q + 8, q in -4..3) are as 6-bit ones below, w = d * s * (u
// - 8), an int8 s a 16 inputs.
//
// 5-bit weights (GGUF's Q5_0, Q5_1, Q5_K) are w = d * u + m as 4-bit ones, u in 0..31. 6-bit weights
// (GGUF's Q6_K) are w = d * s * (u - 32) with u in 0..63, an int8 s for each 16 inputs and d for the
// block: the two halves of a block sum apart, sum(u * q_x) - 32 * sum(q_x) each (the sums start from the
// second term), and are weighed by their s in int32 (exact) before the one float multiply by d * d_x.
//
// K-quants (Q4_K, Q5_K, Q6_K) keep d (and m) for a super-block of 256 inputs, and each block's multiples
// of them in a byte: there a block's d and m are the super-block's times those (exact in float32), and the
// rest is as above. A super-block layout is told from blocks of 32 by its size.
//
// 2-bit super-blocks (GGUF's Q2_K) keep an s and an m for each 16 inputs, w = d * s * u + minimum * m with
// u in 0..3: each half of a block sums apart, sum(u * q_x) weighed by its s and the half's sum(q_x) by its
// m, both in int32 (exact), then d * d_x and minimum * d_x weigh the two totals.
//
// CPUs without AVX-512 VNNI but with AVX2 (AMD before Zen 4, Intel's desktop parts) take the same blocks
// eight channels at a time: vpmaddubsw multiplies pairs of bytes into int16 sums and vpmaddwd adds those
// into int32. vpmaddubsw saturates at 32767, which 8-bit weights (u up to 255) would reach, so there the
// 8-bit weights are multiplied signed, q = u - 128, as llama.cpp does: |q| times q_x with q's sign, and
// the m term falls away. The activations' int8 values are the same in both.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "fused_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define BLOCK_MATMUL_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLOCK_MATMUL_AVX2 1
#endif
#if defined(BLOCK_MATMUL_VNNI) || defined(BLOCK_MATMUL_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;     // inputs a scale covers: GGUF's Q4_0, Q4_1 and Q8_0 blocks
constexpr int64_t CHANNELS = 16;  // output channels stored side by side, one a 32-bit lane
// Rows of activations multiplied per pass over a group's weights: each keeps one accumulator register
// (AVX2 has 16 registers where AVX-512 has 32, and takes a group in two halves).
constexpr int64_t ROWS_AT_ONCE = 8;
constexpr int64_t ROWS_AT_ONCE_AVX2 = 4;
// Pieces of a product a thread takes, on average: enough that a thread that lost its core leaves little.
constexpr int64_t CHUNKS_A_THREAD = 8;

// Bytes of one block of 16 channels: their values, then their fp16 scales d (and, 4-bit and 5-bit,
// minimums m). 8-bit blocks have m = -128 d (u = q + 128), so they store d alone. 5-bit and 6-bit blocks
// keep their values' low nibbles as 4-bit ones do, then one line of fifth bits (bit j of a byte: line j's)
// or two of top two bits (bits 2i and 2i + 1 of line h: line 4h + i's); a 6-bit block then has d and the
// 16 channels' s for inputs 0-15 and for 16-31.
constexpr int64_t LOW_NIBBLES = 256;
// 2-bit values are two lines, bits 2i and 2i + 1 of line h those of line 4h + i (as 6-bit top lines).
constexpr int64_t value_bytes(int64_t bits) {
  return bits == 8 ? 512 : bits == 2 ? 128 : LOW_NIBBLES + (bits - 4) * 64;
}
constexpr int32_t SIX_BIT_OFFSET = 32;  // 6-bit weights are d * s * (u - 32)

// GGUF's IQ4_NL and IQ4_XS weights are d * t[u]: u in 0..15 picks one of 16 int8 values t, denser near 0
// than a 4-bit grid; MXFP4's (OCP's E2M1 values, doubled: llama.cpp's, gpt-oss's) are d * t[u] so too, d a
// power of two. Their blocks (`table`: which table, block_weights.Table) keep u as 4-bit ones do and d
// alone, and the kernels look the values up (vpshufb) and multiply them as 8-bit ones: t + 128 unsigned
// with m = -128 d (AVX-512), or t signed (AVX2).
constexpr int NO_TABLE = 0, IQ4_TABLE = 1, MXFP4_TABLE = 2;
alignas(16) constexpr int8_t TABLE_VALUES[3][16] = {
    {},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}};
alignas(16) constexpr uint8_t TABLE_VALUES_PLUS_128[3][16] = {
    {},
    {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241},
    {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116}};
// Whether blocks keep an fp16 m beside d: 4-bit and 5-bit ones but a table's and symmetric ones (and 2-bit
// super-blocks, a minimum in their header).
constexpr bool has_minimum(int64_t bits, bool table = false, bool symmetric = false) {
  return (bits == 2 || bits == 4 || bits == 5) && !table && !symmetric;
}
// The m of a block without one, in units of -d: values u - 2^(bits - 1), or (8-bit, a table's) u - 128.
constexpr float centre(int64_t bits, bool table) {
  return table || bits == 8 ? 128.f : static_cast<float>(1 << (bits - 1));
}
// A block's fp16 d, and m (4-bit and 5-bit) or the 16 channels' two int8 s (6-bit), after its values.
constexpr int64_t block_bytes(int64_t bits, bool table = false, bool symmetric = false) {
  return value_bytes(bits) + (has_minimum(bits, table, symmetric) || bits == 6 ? 64 : 32);
}

// GGUF's K-quants keep one fp16 d (and minimum) for a channel's super-block of 256 inputs, and for each
// block of 32 in it 6-bit multiples s and m of those (Q4_K, Q5_K), or two int8 s (Q6_K). Super-blocks keep
// them so: the 16 channels' fp16 d (and, 4-bit and 5-bit, minimum) first, then the 8 blocks, each its
// values and 32 bytes: the 16 channels' s, then their m (uint8; 6-bit: s for inputs 0-15, then 16-31, int8).
// 148, 180 and 210 bytes a channel's 256 inputs where blocks of 32 take 160, 192 and 224: what one row's
// product reads. IQ4_XS's (a table's) blocks keep 16 bytes, the channels' s as int8; 2-bit ones (Q2_K) 64:
// the 16 channels' s for inputs 0-15, then for 16-31, then their m so (uint8), 100 bytes a channel's 256.
constexpr int64_t BLOCKS_A_SUPER_BLOCK = 8;
constexpr int64_t header_bytes(int64_t bits, bool table, bool symmetric = false) {
  return has_minimum(bits, table, symmetric) ? 64 : 32;
}
constexpr int64_t stride(int64_t bits, bool super, bool table, bool symmetric = false) {
  return super ? value_bytes(bits) + (table ? 16 : bits == 2 ? 64 : 32) : block_bytes(bits, table, symmetric);
}
constexpr int64_t super_block_bytes(int64_t bits, bool table, bool symmetric = false) {
  return header_bytes(bits, table, symmetric) + BLOCKS_A_SUPER_BLOCK * stride(bits, true, table, symmetric);
}
// Blocks whose each 16 inputs have an int8 s, w = d * s * (u - centre): 6-bit ones (Q6_K) and symmetric
// 4-bit super-blocks (Q3_K's values).
constexpr bool has_signed_scales(int64_t bits, bool super, bool symmetric) { return bits == 6 || (super && symmetric); }

// Two int16 values as one int32, the first in its low half (a lane's two int16 for vpmaddwd).
inline int32_t two_int16(int32_t first, int32_t second) {
  return static_cast<int32_t>(static_cast<uint16_t>(first) | (static_cast<uint32_t>(static_cast<uint16_t>(second)) << 16));
}
// Four activations (int8) as one int32, to broadcast to every lane: copied, which compilers turn into one
// load, since reading the int8 buffer through an int32_t pointer breaks strict aliasing (undefined behaviour).
inline int32_t four_values(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return four;
}

// Blocks ahead of the one being multiplied whose lines each step asks the memory for. A group's weights are
// read once, in order, but the hardware's prefetcher starts over at each chunk a thread takes and at each
// page: one row's products read 4-bit blocks at 38-51 GB/s, and 8 rows took 4x one row's time. Asked 8
// blocks (2.5 KB of 4-bit) ahead, the 1B Llama's 4-bit projections ran 1.14-1.18x as fast at 1 row,
// 2.6-2.9x at 8 and 1.4-1.5x at 32 (6-bit: 1.04x, 3.1x, 1.7x), the two builds in one process, in turn
// (docs/performance.md, 2026-11-28).
constexpr int64_t PREFETCH_BLOCKS = 8;

template <int64_t STRIDE>  // a block's bytes
inline void prefetch_ahead(const uint8_t* block) {
  const uint8_t* ahead = block + PREFETCH_BLOCKS * STRIDE;
  for (int64_t line = 0; line < STRIDE; line += 64) __builtin_prefetch(ahead + line, 0, 3);
}

// Activations in blocks of 32: int8 values, and for each block d and d * sum(values); for 6-bit weights
// also the sums of each half block (the u - 32 of their two s): -32 times each (AVX-512), or the two
// side by side as int16 (AVX2, whose vpmaddwd weighs them by their s in one step).
struct QuantizedRows {
  std::vector<int8_t> values;      // [rows, in]
  std::vector<float> scales;       // [rows, in / 32]
  std::vector<float> sums;         // [rows, in / 32]
  std::vector<int32_t> offsets;    // [rows, in / 16]: -SIX_BIT_OFFSET times the half block's sum (AVX-512)
  std::vector<int32_t> half_sums;  // [rows, in / 32]: the first half's sum, then the second's, int16 (AVX2)
};

QuantizedRows rows_of(int64_t rows, int64_t in, bool avx2) {
  const int64_t blocks = rows * in / BLOCK;
  return {std::vector<int8_t>(rows * in), std::vector<float>(blocks), std::vector<float>(blocks),
          std::vector<int32_t>(avx2 ? 0 : 2 * blocks), std::vector<int32_t>(avx2 ? blocks : 0)};
}

#ifdef BLOCK_MATMUL_VNNI

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 bytes (one a channel) as int32.
inline __m512i bytes_as_ints(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Two lots of 16 bytes (one a channel), at p and p + 16, as each channel's two side by side in int16.
inline __m512i byte_pairs_as_int16(const uint8_t* p) {
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi8(first, second), _mm_unpacklo_epi8(first, second));
  return _mm512_cvtepu8_epi16(pairs);
}
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / BLOCK;
  QuantizedRows out = rows_of(rows, in, false);
  const __m512 sign = _mm512_set1_ps(-0.f), infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const __m512 low = load16(x + b * BLOCK), high = load16(x + b * BLOCK + 16);
    const __m512 low_magnitude = _mm512_andnot_ps(sign, low), high_magnitude = _mm512_andnot_ps(sign, high);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(low_magnitude, high_magnitude));
    // vmaxps keeps a NaN in some lanes and drops it in others, and a NaN value rounds to -128: a block
    // with a NaN (or an infinity) gets a NaN scale, so that every product of its row is NaN.
    const bool finite = (_mm512_cmp_ps_mask(low_magnitude, infinity, _CMP_NLT_UQ) |
                         _mm512_cmp_ps_mask(high_magnitude, infinity, _CMP_NLT_UQ)) == 0;
    const float scale = finite ? largest / 127.f : std::numeric_limits<float>::quiet_NaN();
    const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
    // Rounded to nearest, ties to even (the default rounding mode), as torch.round does.
    const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
    const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values.data() + b * BLOCK), _mm512_cvtsepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values.data() + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q_high));
    const int32_t low_sum = _mm512_reduce_add_epi32(q_low), high_sum = _mm512_reduce_add_epi32(q_high);
    out.scales[b] = scale;
    out.sums[b] = scale * static_cast<float>(low_sum + high_sum);
    out.offsets[2 * b] = -SIX_BIT_OFFSET * low_sum;
    out.offsets[2 * b + 1] = -SIX_BIT_OFFSET * high_sum;
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

// u[j]: inputs 4j..4j+3 of the block at `weights` for each of its 16 channels, 0..2^BITS - 1. 4-bit: byte i
// of a 64-byte line holds u[2c] in its low nibble and u[2c + 1] in its high one.
template <int BITS, int TABLE>
inline void unpack_values(const uint8_t* weights, __m512i u[8]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if constexpr (BITS == 2) {  // bits 2i and 2i + 1 of line h are u[4h + i]
    const __m512i two = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
      const __m512i line = _mm512_loadu_si512(weights + 64 * h);
      u[4 * h] = _mm512_and_si512(line, two);
      for (int i = 1; i < 4; ++i) u[4 * h + i] = _mm512_and_si512(_mm512_srli_epi16(line, 2 * i), two);
    }
  } else if constexpr (BITS != 8) {
    for (int c = 0; c < 4; ++c) {
      const __m512i line = _mm512_loadu_si512(weights + 64 * c);
      u[2 * c] = _mm512_and_si512(line, nibble);
      u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(line, 4), nibble);
    }
    if constexpr (TABLE) {  // u = t[u] + 128, unsigned
      const __m512i values =
          _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(TABLE_VALUES_PLUS_128[TABLE])));
      for (int j = 0; j < 8; ++j) u[j] = _mm512_shuffle_epi8(values, u[j]);
    }
  } else {
    for (int j = 0; j < 8; ++j) u[j] = _mm512_loadu_si512(weights + 64 * j);
  }
  if constexpr (BITS == 5) {  // bit j of the line is bit 4 of u[j]
    const __m512i fifth = _mm512_set1_epi8(0x10), line = _mm512_loadu_si512(weights + LOW_NIBBLES);
    const __m512i top[8] = {_mm512_slli_epi16(line, 4), _mm512_slli_epi16(line, 3), _mm512_slli_epi16(line, 2),
                            _mm512_slli_epi16(line, 1), line,                        _mm512_srli_epi16(line, 1),
                            _mm512_srli_epi16(line, 2), _mm512_srli_epi16(line, 3)};
    for (int j = 0; j < 8; ++j) u[j] = _mm512_or_si512(u[j], _mm512_and_si512(top[j], fifth));
  }
  if constexpr (BITS == 6) {
    // Bits 2i and 2i + 1 of top line h are bits 4 and 5 of u[4h + i].
    const __m512i top_two = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i line = _mm512_loadu_si512(weights + LOW_NIBBLES + 64 * h);
      const __m512i top[4] = {_mm512_slli_epi16(line, 4), _mm512_slli_epi16(line, 2), line, _mm512_srli_epi16(line, 2)};
      for (int i = 0; i < 4; ++i) u[4 * h + i] = _mm512_or_si512(u[4 * h + i], _mm512_and_si512(top[i], top_two));
    }
  }
}

// 16 bytes (one a channel) as floats: a super-block's blocks' multiples of its d and minimum.
inline __m512 bytes_as_floats(const uint8_t* p) { return _mm512_cvtepi32_ps(bytes_as_ints(p)); }

// Rows [first, first + count) of x times one group of 16 output channels, whose blocks start at `weights`:
// blocks of 32 with their own fp16 scales, or (SUPER) super-blocks of 256 whose blocks keep multiples of
// the super-block's.
template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
void multiply_group(const uint8_t* weights, const QuantizedRows& x, int64_t first, int64_t count, int64_t in,
                    T* out, int64_t out_stride) {
  const int64_t blocks = in / BLOCK;
  __m512 sums[ROWS_AT_ONCE];
  for (int64_t r = 0; r < count; ++r) sums[r] = _mm512_setzero_ps();
  __m512 super_d = _mm512_setzero_ps(), super_minimum = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (SUPER) {
      if (b % BLOCKS_A_SUPER_BLOCK == 0) {
        super_d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights)));
        if constexpr (has_minimum(BITS, TABLE, SYMMETRIC)) {
          super_minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 32)));
        }
        weights += header_bytes(BITS, TABLE, SYMMETRIC);
      }
    }
    prefetch_ahead<stride(BITS, SUPER, TABLE, SYMMETRIC)>(weights);
    __m512i u[8];
    unpack_values<BITS, TABLE>(weights, u);
    const uint8_t* scales = weights + value_bytes(BITS);
    weights += stride(BITS, SUPER, TABLE, SYMMETRIC);
    if constexpr (BITS == 2) {
      const __m512i low_s = bytes_as_ints(scales), high_s = bytes_as_ints(scales + 16);
      const __m512i m_pairs = byte_pairs_as_int16(scales + 32);  // each channel's two m
      for (int64_t r = 0; r < count; ++r) {
        const int64_t row_block = (first + r) * blocks + b;
        const int8_t* q = x.values.data() + row_block * BLOCK;
        __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          low = _mm512_dpbusd_epi32(low, u[j], _mm512_set1_epi32(four_values(q + 4 * j)));
          high = _mm512_dpbusd_epi32(high, u[4 + j], _mm512_set1_epi32(four_values(q + 16 + 4 * j)));
        }
        const __m512i scaled = _mm512_add_epi32(_mm512_mullo_epi32(low, low_s), _mm512_mullo_epi32(high, high_s));
        // The two half sums, int16 side by side, times each channel's two m
        const int32_t halves = two_int16(x.offsets[2 * row_block] / -SIX_BIT_OFFSET,
                                         x.offsets[2 * row_block + 1] / -SIX_BIT_OFFSET);
        const __m512i minimums = _mm512_madd_epi16(_mm512_set1_epi32(halves), m_pairs);
        const __m512 x_scale = _mm512_set1_ps(x.scales[row_block]);
        sums[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled), _mm512_mul_ps(super_d, x_scale), sums[r]);
        sums[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(minimums), _mm512_mul_ps(super_minimum, x_scale), sums[r]);
      }
      continue;
    }
    if constexpr (has_signed_scales(BITS, SUPER, SYMMETRIC)) {
      // The rows' offsets are -32 times a half's sum: a quarter of them for 4-bit values (-8 times).
      constexpr int32_t offset_divisor = SIX_BIT_OFFSET / static_cast<int32_t>(centre(BITS, TABLE));
      const __m512 d = SUPER ? super_d : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      const uint8_t* s = SUPER ? scales : scales + 32;  // the 16 channels' s for inputs 0-15, then 16-31
      const __m512i low_s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
      const __m512i high_s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
      for (int64_t r = 0; r < count; ++r) {
        const int64_t row_block = (first + r) * blocks + b;
        const int8_t* q = x.values.data() + row_block * BLOCK;
        __m512i low = _mm512_set1_epi32(x.offsets[2 * row_block] / offset_divisor);
        __m512i high = _mm512_set1_epi32(x.offsets[2 * row_block + 1] / offset_divisor);
        for (int j = 0; j < 4; ++j) {
          low = _mm512_dpbusd_epi32(low, u[j], _mm512_set1_epi32(four_values(q + 4 * j)));
          high = _mm512_dpbusd_epi32(high, u[4 + j], _mm512_set1_epi32(four_values(q + 16 + 4 * j)));
        }
        low = _mm512_mullo_epi32(low, low_s);
        high = _mm512_mullo_epi32(high, high_s);
        const __m512 products = _mm512_cvtepi32_ps(_mm512_add_epi32(low, high));
        sums[r] = _mm512_fmadd_ps(products, _mm512_mul_ps(d, _mm512_set1_ps(x.scales[row_block])), sums[r]);
      }
      continue;
    }
    __m512 d, m;
    if constexpr (TABLE) {  // as 8-bit: m = -128 d; IQ4_XS's d * s (s signed), exactly
      d = SUPER ? _mm512_mul_ps(super_d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)))))
                : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      m = _mm512_mul_ps(d, _mm512_set1_ps(-centre(BITS, TABLE)));
    } else if constexpr (SUPER) {  // d * s and the minimum times m, exactly (an 11-bit d times a 6-bit s)
      d = _mm512_mul_ps(super_d, bytes_as_floats(scales));
      m = _mm512_mul_ps(super_minimum, bytes_as_floats(scales + 16));
    } else {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      m = has_minimum(BITS, TABLE, SYMMETRIC)
              ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)))
              : _mm512_mul_ps(d, _mm512_set1_ps(-centre(BITS, TABLE)));
    }
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row_block = (first + r) * blocks + b;
      const int8_t* q = x.values.data() + row_block * BLOCK;
      // Two chains of four, so that each product need not wait for the one before.
      __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(four_values(q)));
      __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], _mm512_set1_epi32(four_values(q + 4)));
      for (int j = 2; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, u[j], _mm512_set1_epi32(four_values(q + 4 * j)));
        odd = _mm512_dpbusd_epi32(odd, u[j + 1], _mm512_set1_epi32(four_values(q + 4 * j + 4)));
      }
      const __m512 products = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      sums[r] = _mm512_fmadd_ps(products, _mm512_mul_ps(d, _mm512_set1_ps(x.scales[row_block])), sums[r]);
      sums[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[row_block]), sums[r]);
    }
  }
  for (int64_t r = 0; r < count; ++r) store16(out + (first + r) * out_stride, sums[r]);
}

#endif  // BLOCK_MATMUL_VNNI

#ifdef BLOCK_MATMUL_AVX2

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float largest_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// As quantize_rows, eight values a register: the same int8 values and scales.
template <typename T>
QuantizedRows quantize_rows_avx2(const T* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / BLOCK;
  QuantizedRows out = rows_of(rows, in, true);
  const __m256 sign = _mm256_set1_ps(-0.f), infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane order
  for (int64_t b = 0; b < rows * blocks; ++b) {
    __m256 v[4];
    __m256 largest = _mm256_setzero_ps(), not_finite = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * BLOCK + 8 * i);
      const __m256 magnitude = _mm256_andnot_ps(sign, v[i]);
      largest = _mm256_max_ps(largest, magnitude);
      not_finite = _mm256_or_ps(not_finite, _mm256_cmp_ps(magnitude, infinity, _CMP_NLT_UQ));
    }
    const float top = largest_of(largest);
    const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.values.data() + b * BLOCK),
                        _mm256_permutevar8x32_epi32(packed, in_order));
    // As quantize_rows: a NaN or an infinity makes the block's scale NaN, so that its row's products are.
    out.scales[b] = _mm256_movemask_ps(not_finite) == 0 ? top / 127.f : std::numeric_limits<float>::quiet_NaN();
    const int32_t low_sum = sum_of(_mm256_add_epi32(q[0], q[1])), high_sum = sum_of(_mm256_add_epi32(q[2], q[3]));
    out.sums[b] = out.scales[b] * static_cast<float>(low_sum + high_sum);
    // |sum| <= 16 * 127: each fits int16
    out.half_sums[b] = two_int16(low_sum, high_sum);
  }
  return out;
}

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(c10::BFloat16* out, __m256 v) {
  alignas(32) float values[8];
  _mm256_store_ps(values, v);
  for (int i = 0; i < 8; ++i) out[i] = c10::BFloat16(values[i]);  // rounded to nearest even
}

// As unpack_values, for the 8 channels whose bytes start at `values` (32h of each 64-byte line: channels
// 8h..8h+7). 8-bit values come signed, q = u - 128.
template <int BITS, int TABLE>
inline void unpack_values_avx2(const uint8_t* values, __m256i u[8]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), offset = _mm256_set1_epi8(static_cast<char>(0x80));
  if constexpr (BITS == 2) {  // as unpack_values: bits 2i and 2i + 1 of line h are u[4h + i]
    const __m256i two = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
      const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 64 * h));
      u[4 * h] = _mm256_and_si256(line, two);
      for (int i = 1; i < 4; ++i) u[4 * h + i] = _mm256_and_si256(_mm256_srli_epi16(line, 2 * i), two);
    }
  } else if constexpr (BITS != 8) {
    for (int c = 0; c < 4; ++c) {
      const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 64 * c));
      u[2 * c] = _mm256_and_si256(line, nibble);
      u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(line, 4), nibble);
    }
    if constexpr (TABLE) {  // u = t[u], signed, as 8-bit ones here
      const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(TABLE_VALUES[TABLE])));
      for (int j = 0; j < 8; ++j) u[j] = _mm256_shuffle_epi8(table, u[j]);
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      u[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 64 * j)), offset);
    }
  }
  if constexpr (BITS == 5) {  // as unpack_values: bit j of the line to bit 4 of u[j]
    const __m256i fifth = _mm256_set1_epi8(0x10);
    const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + LOW_NIBBLES));
    const __m256i top[8] = {_mm256_slli_epi16(line, 4), _mm256_slli_epi16(line, 3), _mm256_slli_epi16(line, 2),
                            _mm256_slli_epi16(line, 1), line,                        _mm256_srli_epi16(line, 1),
                            _mm256_srli_epi16(line, 2), _mm256_srli_epi16(line, 3)};
    for (int j = 0; j < 8; ++j) u[j] = _mm256_or_si256(u[j], _mm256_and_si256(top[j], fifth));
  }
  if constexpr (BITS == 6) {  // as unpack_values: bits 2i, 2i + 1 of top line h to bits 4, 5 of u[4h + i]
    const __m256i top_two = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + LOW_NIBBLES + 64 * h));
      const __m256i top[4] = {_mm256_slli_epi16(line, 4), _mm256_slli_epi16(line, 2), line, _mm256_srli_epi16(line, 2)};
      for (int i = 0; i < 4; ++i) u[4 * h + i] = _mm256_or_si256(u[4 * h + i], _mm256_and_si256(top[i], top_two));
    }
  }
}

inline __m256 halves_as_floats(const uint8_t* p) {  // 8 fp16 values
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 bytes_as_floats_avx2(const uint8_t* p) {  // 8 uint8 values
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One half of the block at `block` (its channels 8 half..8 half + 7) times rows [first, first + count) of x,
// added to sums[0..count): the products weighed by the block's scales (of a super-block, by super_d and
// super_minimum, its header's).
template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC>
__attribute__((always_inline)) inline void multiply_block_half(const uint8_t* block, int half, const QuantizedRows& x,
                                                               int64_t first, int64_t count, int64_t blocks, int64_t b,
                                                               __m256 super_d, __m256 super_minimum, __m256* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i u[8];  // 2-bit: u, 0..3; 4-bit: 0..15; 5-bit: 0..31; 6-bit: 0..63; 8-bit: q = u - 128, and a table's t[u], signed
  unpack_values_avx2<BITS, TABLE>(block + 32 * half, u);
  const uint8_t* scales = block + value_bytes(BITS);
  if constexpr (BITS == 2) {
    // As 6-bit ones below, each channel's s in both int16 of its lane, and its two m side by side: one
    // vpmaddwd of the two half sums gives the lane's m term, as in the AVX-512 kernel.
    const __m128i low_bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * half));
    const __m128i high_bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 16 + 8 * half));
    const __m256i low_s = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(low_bytes, low_bytes));
    const __m256i high_s = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(high_bytes, high_bytes));
    const __m128i low_m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 32 + 8 * half));
    const __m128i high_m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 48 + 8 * half));
    const __m256i m_pairs = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(low_m, high_m));
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row_block = (first + r) * blocks + b;
      const int8_t* q = x.values.data() + row_block * BLOCK;
      // A half's four vpmaddubsw sums (2 * 3 * 127 each at most) fit int16
      __m256i scaled = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        __m256i pairs = _mm256_maddubs_epi16(u[4 * h], _mm256_set1_epi32(four_values(q + 16 * h)));
        for (int j = 1; j < 4; ++j) {
          const __m256i x_four = _mm256_set1_epi32(four_values(q + 16 * h + 4 * j));
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[4 * h + j], x_four));
        }
        scaled = _mm256_add_epi32(scaled, _mm256_madd_epi16(pairs, h == 0 ? low_s : high_s));
      }
      const __m256i minimums = _mm256_madd_epi16(_mm256_set1_epi32(x.half_sums[row_block]), m_pairs);
      const __m256 x_scale = _mm256_set1_ps(x.scales[row_block]);
      sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled), _mm256_mul_ps(super_d, x_scale), sums[r]);
      sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(minimums), _mm256_mul_ps(super_minimum, x_scale), sums[r]);
    }
    return;
  }
  if constexpr (has_signed_scales(BITS, SUPER, SYMMETRIC)) {
    constexpr int centre_shift = BITS == 6 ? 5 : 3;  // -32 s, or (4-bit values) -8 s
    const __m256 d = SUPER ? super_d : halves_as_floats(scales + 16 * half);
    const uint8_t* s = (SUPER ? scales : scales + 32) + 8 * half;  // this half's 8 channels' s, inputs 0-15
    const __m128i low_bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    const __m128i high_bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16));
    // vpmaddwd weighs the pairs' int16 sums by s, exactly: each channel's s in both int16 of its lane. And
    // -32 s of the two halves side by side, by which one vpmaddwd gives the lane's offsets from the two
    // half sums. The int32 sums weighed by two vpmulld (slow on AMD's Zen 1) instead, 8 and 32 rows took
    // 1.10-1.18x as long on the AVX2 EPYC (docs/performance.md, 2026-12-06).
    const __m256i low_s = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(low_bytes, low_bytes));
    const __m256i high_s = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(high_bytes, high_bytes));
    const __m256i offset_s = _mm256_slli_epi16(  // -32 s (or -8 s), |s| <= 128: fits int16
        _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(low_bytes, high_bytes))),
        centre_shift);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row_block = (first + r) * blocks + b;
      const int8_t* q = x.values.data() + row_block * BLOCK;
      __m256i total = _mm256_madd_epi16(_mm256_set1_epi32(x.half_sums[row_block]), offset_s);
      // Two vpmaddubsw sums of 63 * 127 pairs still fit int16; three would not.
      for (int j = 0; j < 8; j += 2) {
        const __m256i pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(four_values(q + 4 * j))),
            _mm256_maddubs_epi16(u[j + 1], _mm256_set1_epi32(four_values(q + 4 * j + 4))));
        total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, j < 4 ? low_s : high_s));
      }
      sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[row_block])), sums[r]);
    }
    return;
  }
  __m256 d, m;
  if constexpr (TABLE) {
    d = SUPER ? _mm256_mul_ps(super_d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * half)))))
              : halves_as_floats(scales + 16 * half);
    m = _mm256_setzero_ps();
  } else if constexpr (SUPER) {
    d = _mm256_mul_ps(super_d, bytes_as_floats_avx2(scales + 8 * half));
    m = _mm256_mul_ps(super_minimum, bytes_as_floats_avx2(scales + 16 + 8 * half));
  } else {
    d = halves_as_floats(scales + 16 * half);
    // 8-bit values come signed here (no m); symmetric ones unsigned, as 4-bit and 5-bit ones with an m.
    if constexpr (SYMMETRIC) {
      m = _mm256_mul_ps(d, _mm256_set1_ps(-centre(BITS, TABLE)));
    } else {
      m = has_minimum(BITS) ? halves_as_floats(scales + 32 + 16 * half) : _mm256_setzero_ps();
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row_block = (first + r) * blocks + b;
    const int8_t* q = x.values.data() + row_block * BLOCK;
    __m256i products;
    if constexpr ((BITS == 4 || BITS == 5) && !TABLE) {
      // Each vpmaddubsw sum is at most 2 * 15 * 127 (4-bit) or 2 * 31 * 127 (5-bit), so eight (or four)
      // of them still fit in int16.
      constexpr int in_int16 = BITS == 4 ? 8 : 4;
      products = _mm256_setzero_si256();
      for (int j0 = 0; j0 < 8; j0 += in_int16) {
        __m256i pairs = _mm256_maddubs_epi16(u[j0], _mm256_set1_epi32(four_values(q + 4 * j0)));
        for (int j = j0 + 1; j < j0 + in_int16; ++j) {
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(four_values(q + 4 * j))));
        }
        products = _mm256_add_epi32(products, _mm256_madd_epi16(pairs, ones));
      }
    } else {
      products = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four_values(q + 4 * j)), u[j]);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(u[j]), signed_x);
        products = _mm256_add_epi32(products, _mm256_madd_epi16(pairs, ones));
      }
    }
    sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_mul_ps(d, _mm256_set1_ps(x.scales[row_block])), sums[r]);
    if constexpr (has_minimum(BITS, TABLE) || SYMMETRIC) {
      sums[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sums[row_block]), sums[r]);
    }
  }
}

// A super-block's header for the half's 8 channels: their d and (4-bit and 5-bit, but symmetric) minimum.
template <int BITS, int TABLE, bool SYMMETRIC>
inline void read_super_header(const uint8_t* block, int half, __m256& super_d, __m256& super_minimum) {
  super_d = halves_as_floats(block + 16 * half);
  if constexpr (has_minimum(BITS, TABLE, SYMMETRIC)) super_minimum = halves_as_floats(block + 32 + 16 * half);
}

// multiply_group_avx2 for row `row` alone, into out[0..16): both halves of each block in turn, one pass over
// the group's blocks.
template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
void multiply_row_in_one_pass(const uint8_t* weights, const QuantizedRows& x, int64_t row, int64_t in, T* out) {
  const int64_t blocks = in / BLOCK;
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 super_d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 super_minimum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const uint8_t* block = weights;
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (SUPER) {
      if (b % BLOCKS_A_SUPER_BLOCK == 0) {
        for (int half = 0; half < 2; ++half) {
          read_super_header<BITS, TABLE, SYMMETRIC>(block, half, super_d[half], super_minimum[half]);
        }
        block += header_bytes(BITS, TABLE, SYMMETRIC);
      }
    }
    prefetch_ahead<stride(BITS, SUPER, TABLE, SYMMETRIC)>(block);
    for (int half = 0; half < 2; ++half) {
      multiply_block_half<BITS, SUPER, TABLE, SYMMETRIC>(block, half, x, row, 1, blocks, b, super_d[half],
                                                         super_minimum[half], &sums[half]);
    }
    block += stride(BITS, SUPER, TABLE, SYMMETRIC);
  }
  for (int half = 0; half < 2; ++half) store8(out + 8 * half, sums[half]);
}

// As multiply_group, for rows [first, first + count) (count <= ROWS_AT_ONCE_AVX2), one half of the 16
// channels at a time: bytes 32h..32h+31 of each 64-byte line are channels 8h..8h+7, and so are the 16h-th
// bytes of the fp16 scales and the 8h-th of the byte ones. One row of 2-bit, 4-bit or 8-bit weights takes
// both halves of each block in turn instead (multiply_row_in_one_pass): a pass over the group for each half
// read each line twice, and one row's products, which do little with each weight, took 1.2-1.4x as long so
// (layers of 8,192 x 2,048 from memory, the two builds in one process, on the AVX2 EPYC; docs/performance.md,
// 2026-12-06). 5-bit and 6-bit rows, whose values take more registers to unpack, ran 0.86-0.98x as fast in
// one pass, and more rows keep a half at a time: their accumulators and one half's values fill the 16
// registers.
template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
void multiply_group_avx2(const uint8_t* weights, const QuantizedRows& x, int64_t first, int64_t count, int64_t in,
                         T* out, int64_t out_stride) {
  const int64_t blocks = in / BLOCK;
  if constexpr (BITS == 2 || BITS == 4 || BITS == 8) {
    if (count == 1) {
      return multiply_row_in_one_pass<BITS, SUPER, TABLE, SYMMETRIC>(weights, x, first, in, out + first * out_stride);
    }
  }
  for (int half = 0; half < 2; ++half) {
    __m256 sums[ROWS_AT_ONCE_AVX2];
    for (int64_t r = 0; r < count; ++r) sums[r] = _mm256_setzero_ps();
    __m256 super_d = _mm256_setzero_ps(), super_minimum = _mm256_setzero_ps();
    const uint8_t* block = weights;
    for (int64_t b = 0; b < blocks; ++b) {
      if constexpr (SUPER) {
        if (b % BLOCKS_A_SUPER_BLOCK == 0) {
          read_super_header<BITS, TABLE, SYMMETRIC>(block, half, super_d, super_minimum);
          block += header_bytes(BITS, TABLE, SYMMETRIC);
        }
      }
      // the second half finds the lines in the cache
      if (half == 0) prefetch_ahead<stride(BITS, SUPER, TABLE, SYMMETRIC)>(block);
      multiply_block_half<BITS, SUPER, TABLE, SYMMETRIC>(block, half, x, first, count, blocks, b, super_d,
                                                         super_minimum, sums);
      block += stride(BITS, SUPER, TABLE, SYMMETRIC);
    }
    for (int64_t r = 0; r < count; ++r) store8(out + (first + r) * out_stride + 8 * half, sums[r]);
  }
}

#endif  // BLOCK_MATMUL_AVX2

// One group of 16 output channels times rows [first, first + count) of the activations: multiply_group or
// multiply_group_avx2 for 4 or 8 bits.
template <typename T>
using GroupProduct = void (*)(const uint8_t* weights, const QuantizedRows& x, int64_t first, int64_t count,
                              int64_t in, T* out, int64_t out_stride);

// Every group of 16 output channels by `product`, `rows_at_once` rows a pass over its weights. The groups
// are shared out to the threads a few at a time as they get to them, not half each: the server's other
// processes take a core now and then, and a thread that lost its core would leave the other waiting at
// the end of every product. With a process taking a fifth of a core beside the engine, 32-row steps went
// 22% slower with halves and 12% slower this way (docs/performance.md).
template <typename T>
void multiply_groups(GroupProduct<T> product, int64_t rows_at_once, const QuantizedRows& x, int64_t in,
                     const at::Tensor& weights, at::Tensor& result) {
  const int64_t rows = result.size(0), out = result.size(1);
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const int64_t group_bytes = weights.size(1) * CHANNELS;
  T* o = result.data_ptr<T>();
  const int64_t groups = out / CHANNELS;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), groups);
  const int64_t chunk = std::max<int64_t>(1, groups / (CHUNKS_A_THREAD * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < groups;) {
      for (int64_t g = begin; g < std::min(begin + chunk, groups); ++g) {
        for (int64_t first = 0; first < rows; first += rows_at_once) {
          product(w + g * group_bytes, x, first, std::min(rows_at_once, rows - first), in, o + g * CHANNELS, out);
        }
      }
    }
  });
}

// The layouts of blocks, told apart by their size: blocks of 32 or super-blocks of 256, of values or of a
// table's indices.
struct Layout {
  bool super;
  int64_t table;  // NO_TABLE, or whose values the indices pick
  bool symmetric;  // blocks of 32 of 4 or 5 bits with d alone: w = d * (u - 2^(bits - 1))
};

// Each kernel's products by layout, for `product_of`.
#ifdef BLOCK_MATMUL_VNNI
struct Vnni {
  template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
  static constexpr GroupProduct<T> product = multiply_group<BITS, SUPER, TABLE, SYMMETRIC, T>;
};
#endif
#ifdef BLOCK_MATMUL_AVX2
struct Avx2 {
  template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
  static constexpr GroupProduct<T> product = multiply_group_avx2<BITS, SUPER, TABLE, SYMMETRIC, T>;
};
#endif

// The kernel's function for a layout: `Kernel::product<BITS, SUPER, TABLE, SYMMETRIC, T>`.
template <typename Kernel, typename T>
auto product_of(int64_t bits, Layout layout) {
  if (layout.table == IQ4_TABLE) {
    return layout.super ? Kernel::template product<4, true, IQ4_TABLE, false, T>
                        : Kernel::template product<4, false, IQ4_TABLE, false, T>;
  }
  if (layout.table == MXFP4_TABLE) return Kernel::template product<4, false, MXFP4_TABLE, false, T>;
  if (layout.symmetric) {
    return layout.super ? Kernel::template product<4, true, NO_TABLE, true, T>
           : bits == 4  ? Kernel::template product<4, false, NO_TABLE, true, T>
                        : Kernel::template product<5, false, NO_TABLE, true, T>;
  }
  if (layout.super) {
    return bits == 2   ? Kernel::template product<2, true, NO_TABLE, false, T>
           : bits == 4 ? Kernel::template product<4, true, NO_TABLE, false, T>
           : bits == 5 ? Kernel::template product<5, true, NO_TABLE, false, T>
                       : Kernel::template product<6, true, NO_TABLE, false, T>;
  }
  return bits == 4   ? Kernel::template product<4, false, NO_TABLE, false, T>
         : bits == 5 ? Kernel::template product<5, false, NO_TABLE, false, T>
         : bits == 6 ? Kernel::template product<6, false, NO_TABLE, false, T>
                     : Kernel::template product<8, false, NO_TABLE, false, T>;
}

// x times the blocks into result, by the AVX-512 VNNI kernel or, with `avx2`, the AVX2 one.
template <typename T>
void multiply_blocks(const at::Tensor& x, const at::Tensor& weights, int64_t bits, Layout layout, bool avx2,
                     at::Tensor& result) {
  const T* values = x.data_ptr<T>();
  const int64_t rows = x.size(0), in = x.size(1);
#ifdef BLOCK_MATMUL_AVX2
  if (avx2) {
    multiply_groups(product_of<Avx2, T>(bits, layout), ROWS_AT_ONCE_AVX2, quantize_rows_avx2(values, rows, in), in,
                    weights, result);
    return;
  }
#endif
#ifdef BLOCK_MATMUL_VNNI
  if (!avx2) {
    multiply_groups(product_of<Vnni, T>(bits, layout), ROWS_AT_ONCE, quantize_rows(values, rows, in), in, weights,
                    result);
    return;
  }
#endif
  // A kernel this build lacks: the entry points check for it first, and a result left unwritten (at::empty's
  // contents) must never go back, whatever calls this.
  TORCH_CHECK(false, "the ", avx2 ? "AVX2" : "AVX-512 VNNI", " block kernel is not compiled here");
}

constexpr bool has_vnni_kernel() {
#ifdef BLOCK_MATMUL_VNNI
  return true;
#else
  return false;
#endif
}

constexpr bool has_avx2_kernel() {
#ifdef BLOCK_MATMUL_AVX2
  return true;
#else
  return false;
#endif
}

// The layout of weights [out, bytes a channel] holding `bits`-bit values of `in` inputs, a table's indices
// or not, by the bytes a group of 16 channels takes (no two take the same for the same inputs and table:
// a table's blocks of 32 take what symmetric 4-bit ones do); what they must be checked first.
Layout layout_of(const at::Tensor& weights, int64_t in, int64_t bits, int64_t table) {
  TORCH_CHECK(bits == 2 || (bits >= 4 && bits <= 6) || bits == 8, "bits must be 2, 4, 5, 6 or 8, not ", bits);
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 2 && weights.is_contiguous(),
              "weights must be contiguous uint8 [out, in / 32 * bytes]");
  TORCH_CHECK(in % BLOCK == 0 && weights.size(0) % CHANNELS == 0, "in must be a multiple of 32 and out of 16");
  const int64_t group_bytes = weights.size(1) * CHANNELS, super_blocks = in / (BLOCKS_A_SUPER_BLOCK * BLOCK);
  TORCH_CHECK(table >= NO_TABLE && table <= MXFP4_TABLE, "no table ", table);
  TORCH_CHECK(!table || bits == 4, "a table's indices are 4-bit, not ", bits);
  const auto takes = [&](Layout layout) {
    // Symmetric blocks of 32 hold 4 or 5 bits, symmetric super-blocks 4.
    const bool symmetric_bits = layout.super ? bits == 4 : bits == 4 || bits == 5;
    if ((layout.super && (bits == 8 || in % (BLOCKS_A_SUPER_BLOCK * BLOCK) != 0)) || layout.table != table ||
        (layout.symmetric && !symmetric_bits) || (bits == 2 && !layout.super) ||
        (layout.super && layout.table == MXFP4_TABLE)) {  // MXFP4 comes in blocks of 32 alone
      return false;
    }
    return group_bytes == (layout.super ? super_blocks * super_block_bytes(bits, layout.table, layout.symmetric)
                                        : in / BLOCK * block_bytes(bits, layout.table, layout.symmetric));
  };
  const Layout layouts[] = {{false, NO_TABLE, false}, {true, NO_TABLE, false}, {false, table, false},
                            {true, table, false},     {false, NO_TABLE, true}, {true, NO_TABLE, true}};
  const Layout* layout = std::find_if(std::begin(layouts), std::end(layouts), takes);
  TORCH_CHECK(layout != std::end(layouts), "weights do not hold ", bits, "-bit ", table ? "table " : "",
              "blocks or super-blocks of ", in, " inputs");
  return *layout;
}

at::Tensor checked_block_matmul(const at::Tensor& x, const at::Tensor& weights, int64_t bits, int64_t table,
                                bool avx2) {
  TORCH_CHECK(x.device().is_cpu() && weights.device().is_cpu(), "block_matmul runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1), out = weights.size(0);
  const Layout layout = layout_of(weights, in, bits, table);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, not ", x.scalar_type());
  at::Tensor result = at::empty({rows, out}, x.options());
  // Nothing to compute (no rows, or no output channels, which would share 0 groups among 0 threads).
  if (result.numel() == 0) return result;
  if (x.scalar_type() == at::kFloat) {
    multiply_blocks<float>(x, weights, bits, layout, avx2, result);
  } else {
    multiply_blocks<c10::BFloat16>(x, weights, bits, layout, avx2, result);
  }
  return result;
}

// Line `line` of a block's values, u for its 64 lanes (the layout above: lane 4c + k is input 4 line + k
// of channel c): 4-bit to 6-bit lines 2i and 2i + 1 are the low and high nibbles of byte line i, a 5-bit
// line's fifth bit is bit `line` of the fifth-bits line, and a 6-bit line 4h + i's top two bits are bits
// 2i and 2i + 1 of top line h, as a 2-bit line's two bits are.
template <int BITS>
inline void line_values(const uint8_t* values, int64_t line, uint8_t u[64]) {
  for (int64_t lane = 0; lane < 64; ++lane) {
    if constexpr (BITS == 8) {
      u[lane] = values[line * 64 + lane];
    } else if constexpr (BITS == 2) {
      u[lane] = (values[line / 4 * 64 + lane] >> (2 * (line % 4))) & 3;
    } else {
      const uint8_t byte = values[line / 2 * 64 + lane];
      uint8_t value = line % 2 == 0 ? byte & 0x0F : byte >> 4;
      if constexpr (BITS == 5) value |= ((values[LOW_NIBBLES + lane] >> line) & 1) << 4;
      if constexpr (BITS == 6) value |= ((values[LOW_NIBBLES + line / 4 * 64 + lane] >> (2 * (line % 4))) & 3) << 4;
      u[lane] = value;
    }
  }
}

inline float half_at(const uint8_t* p, int64_t index) {
  c10::Half value;
  std::memcpy(&value, p + 2 * index, sizeof value);
  return static_cast<float>(value);
}

// One block of a group of 16 channels to floats, out[c * in + i] for its 32 inputs i: `values` its value
// bytes (its scales follow them), `d` and `minimum` its super-block's (K-quants; else unused). A line at a
// time, over its 64 lanes, so that the compiler takes them in vectors. The arithmetic is
// block_weights.dequantize_in_torch's, in its order, so the same to the last bit: w = u * d + m (d * s and
// minimum * m first, for K-quants; u * d is exact, so a fused multiply-add rounds as the two steps do),
// d * s * (u - 32) as ((u - 32) * s) * d, table[u] * d, and 2-bit u * (d * s) + minimum * m a 16 inputs.
template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
void block_to_floats(const uint8_t* values, const float* d, const float* minimum, T* out, int64_t in) {
  const uint8_t* scales = values + value_bytes(BITS);
  // By lane; 6-bit: s of inputs 0-15, 16-31 (2-bit: d * s and minimum * m of those)
  float scale[64], offset[64] = {}, half_scale[2][64], half_offset[2][64];
  for (int64_t lane = 0; lane < 64; ++lane) {
    const int64_t c = lane / 4;
    if constexpr (TABLE) {
      scale[lane] = SUPER ? d[c] * static_cast<float>(static_cast<int8_t>(scales[c])) : half_at(scales, c);
    } else if constexpr (BITS == 2) {
      for (int64_t half = 0; half < 2; ++half) {
        half_scale[half][lane] = d[c] * static_cast<float>(scales[half * CHANNELS + c]);
        half_offset[half][lane] = minimum[c] * static_cast<float>(scales[(2 + half) * CHANNELS + c]);
      }
    } else if constexpr (has_signed_scales(BITS, SUPER, SYMMETRIC)) {
      const int8_t* s = reinterpret_cast<const int8_t*>(scales + (SUPER ? 0 : 2 * CHANNELS));
      scale[lane] = SUPER ? d[c] : half_at(scales, c);
      for (int64_t half = 0; half < 2; ++half) half_scale[half][lane] = static_cast<float>(s[half * CHANNELS + c]);
    } else if constexpr (SUPER) {
      scale[lane] = d[c] * static_cast<float>(scales[c]);
      offset[lane] = minimum[c] * static_cast<float>(scales[CHANNELS + c]);
    } else {
      scale[lane] = half_at(scales, c);
      offset[lane] = has_minimum(BITS, TABLE, SYMMETRIC) ? half_at(scales, CHANNELS + c)
                                                         : -centre(BITS, TABLE) * scale[lane];
    }
  }
  for (int64_t line = 0; line < 8; ++line) {
    uint8_t u[64];
    line_values<BITS>(values, line, u);
    T w[64];
    for (int64_t lane = 0; lane < 64; ++lane) {
      float value;
      if constexpr (TABLE) {
        value = static_cast<float>(TABLE_VALUES[TABLE][u[lane]]) * scale[lane];
      } else if constexpr (BITS == 2) {
        value = static_cast<float>(u[lane]) * half_scale[line / 4][lane] + half_offset[line / 4][lane];
      } else if constexpr (has_signed_scales(BITS, SUPER, SYMMETRIC)) {
        const float centred = static_cast<float>(static_cast<int32_t>(u[lane]) - centre(BITS, TABLE));
        value = centred * half_scale[line / 4][lane] * scale[lane];
      } else {
        value = static_cast<float>(u[lane]) * scale[lane] + offset[lane];
      }
      w[lane] = static_cast<T>(value);
    }
    for (int64_t c = 0; c < CHANNELS; ++c) std::memcpy(out + c * in + line * 4, w + c * 4, 4 * sizeof(T));
  }
}

// A group of 16 channels' blocks to floats: out [16, in].
template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
void group_to_floats(const uint8_t* group, int64_t in, T* out) {
  if constexpr (!SUPER) {
    for (int64_t block = 0; block < in / BLOCK; ++block) {
      block_to_floats<BITS, SUPER, TABLE, SYMMETRIC>(group + block * block_bytes(BITS, TABLE, SYMMETRIC), nullptr,
                                                     nullptr, out + block * BLOCK, in);
    }
  } else {
    constexpr int64_t inputs = BLOCKS_A_SUPER_BLOCK * BLOCK;
    for (int64_t first = 0; first < in; first += inputs) {
      const uint8_t* super_block = group + first / inputs * super_block_bytes(BITS, TABLE, SYMMETRIC);
      float d[CHANNELS], minimum[CHANNELS] = {};
      for (int64_t c = 0; c < CHANNELS; ++c) {
        d[c] = half_at(super_block, c);
        if constexpr (has_minimum(BITS, TABLE, SYMMETRIC)) minimum[c] = half_at(super_block, CHANNELS + c);
      }
      for (int64_t block = 0; block < BLOCKS_A_SUPER_BLOCK; ++block) {
        const uint8_t* values =
            super_block + header_bytes(BITS, TABLE, SYMMETRIC) + block * stride(BITS, true, TABLE, SYMMETRIC);
        block_to_floats<BITS, SUPER, TABLE, SYMMETRIC>(values, d, minimum, out + first + block * BLOCK, in);
      }
    }
  }
}

template <typename T>
using GroupFloats = void (*)(const uint8_t* group, int64_t in, T* out);

struct ToFloats {
  template <int BITS, bool SUPER, int TABLE, bool SYMMETRIC, typename T>
  static constexpr GroupFloats<T> product = group_to_floats<BITS, SUPER, TABLE, SYMMETRIC, T>;
};

template <typename T>
void blocks_to_floats(const at::Tensor& weights, int64_t bits, Layout layout, at::Tensor& out) {
  const GroupFloats<T> group_floats = product_of<ToFloats, T>(bits, layout);
  const uint8_t* blocks = weights.data_ptr<uint8_t>();
  T* values = out.data_ptr<T>();
  const int64_t in = out.size(1), group_bytes = weights.size(1) * CHANNELS;
  at::parallel_for(0, weights.size(0) / CHANNELS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group_floats(blocks + g * group_bytes, in, values + g * CHANNELS * in);
  });
}

// Rows `ids` of the weights the blocks hold, into out [ids, in]: an embedding's rows (a head tied to it
// keeps its weights in blocks). Each row's group of 16 channels is written by `group_to_floats` into a
// scratch and the row copied out: 16 rows' work, 33 thousand values for a 2,048-wide row, a few
// microseconds; ids in turn share a group's.
template <typename T>
void rows_to_floats(const at::Tensor& weights, int64_t bits, Layout layout, const at::Tensor& ids, at::Tensor& out) {
  const GroupFloats<T> group_floats = product_of<ToFloats, T>(bits, layout);
  const uint8_t* blocks = weights.data_ptr<uint8_t>();
  const int64_t* rows = ids.data_ptr<int64_t>();
  T* values = out.data_ptr<T>();
  const int64_t in = out.size(1), group_bytes = weights.size(1) * CHANNELS;
  at::parallel_for(0, ids.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> group(CHANNELS * in);
    int64_t held = -1;  // the group in `group`
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = rows[i] / CHANNELS;
      if (g != held) {
        group_floats(blocks + g * group_bytes, in, group.data());
        held = g;
      }
      std::copy_n(group.data() + rows[i] % CHANNELS * in, in, values + i * in);
    }
  });
}

}  // namespace

namespace fused_ops {

// The kernel `block_matmul` multiplies by, for the CPU this was compiled for: "AVX-512 VNNI", "AVX2", or
// "" where it has neither (then there are no blocks).
std::string block_matmul_kernel() { return has_vnni_kernel() ? "AVX-512 VNNI" : has_avx2_kernel() ? "AVX2" : ""; }

// x [rows, in] (float32 or bfloat16) times weights [out, bytes a channel's blocks or super-blocks take]
// (block_weights.py's layouts) -> [rows, out] in x's dtype; by AVX-512 VNNI where the CPU has it, else by AVX2.
// `table`: NO_TABLE, or the table whose values the blocks' indices pick (IQ4_TABLE, MXFP4_TABLE).
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weights, int64_t bits, int64_t table) {
  TORCH_CHECK(has_vnni_kernel() || has_avx2_kernel(), "block_matmul needs a CPU with AVX-512 VNNI or AVX2");
  return checked_block_matmul(x, weights, bits, table, !has_vnni_kernel());
}

// The weights that blocks [out, bytes a channel] of `bits`-bit values hold, written into out [out, in]
// (float32 or bfloat16, rounded once from float32): block_weights.dequantize's values, a group of 16
// channels a task, straight from the blocks to their places (PyTorch's operations took 4 s of the 1B
// Q4_K_M file's start).
void block_dequantize(const at::Tensor& weights, int64_t bits, int64_t table, at::Tensor& out) {
  TORCH_CHECK(weights.device().is_cpu() && out.device().is_cpu(), "block_dequantize runs on the CPU");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == weights.size(0),
              "out must be a contiguous [out, in] of the weights' outputs");
  const Layout layout = layout_of(weights, out.size(1), bits, table);
  if (out.scalar_type() == at::kFloat) {
    blocks_to_floats<float>(weights, bits, layout, out);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16, not ", out.scalar_type());
    blocks_to_floats<c10::BFloat16>(weights, bits, layout, out);
  }
}

// Rows `ids` (int64, each below the weights' outputs) of the weights that blocks [out, bytes a channel] of
// `bits`-bit values hold, written into out [ids, in] (float32 or bfloat16, rounded once from float32):
// `block_dequantize`'s values of those rows alone.
void block_rows(const at::Tensor& weights, int64_t bits, int64_t table, const at::Tensor& ids, at::Tensor& out) {
  TORCH_CHECK(weights.device().is_cpu() && ids.device().is_cpu() && out.device().is_cpu(), "block_rows runs on the CPU");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids must be a contiguous int64 [n]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0), "out must be a contiguous [ids, in]");
  const Layout layout = layout_of(weights, out.size(1), bits, table);
  const int64_t* rows = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < weights.size(0), "row ", rows[i], " is not among the ", weights.size(0),
                " rows the blocks hold");
  }
  if (out.scalar_type() == at::kFloat) {
    rows_to_floats<float>(weights, bits, layout, ids, out);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16, not ", out.scalar_type());
    rows_to_floats<c10::BFloat16>(weights, bits, layout, ids, out);
  }
}

// The same by the AVX2 kernel, wherever it is built (an AVX-512 CPU too): for its tests and timings.
at::Tensor block_matmul_avx2(const at::Tensor& x, const at::Tensor& weights, int64_t bits, int64_t table) {
  TORCH_CHECK(has_avx2_kernel(), "block_matmul_avx2 needs a CPU with AVX2, FMA and F16C");
  return checked_block_matmul(x, weights, bits, table, true);
}

}  // namespace fused_ops
