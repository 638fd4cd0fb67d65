// A decode step's layers in one call: DecoderRunner.decode_layers's loop (backend/model/decoder_runner.py), run
// in C++ where every projection is in blocks (block_weights.py) and every operation between them is one of
// this extension's loops. The same functions in the same order, so the same numbers bit for bit; what goes
// is Python's share of a one-row step: some ten calls a layer through the interpreter and pybind, about a
// millisecond of a 5.7 ms step of the default model (docs/performance.md).
#include <ATen/ATen.h>

#include "fused_ops.h"

#include <vector>

namespace fused_ops {

// hidden: [queries, hidden] embeddings, this step's own (the residual adds write into it); cos, sin:
// [queries, 1, head_dim]; slots, rows, positions: as rotate_and_store and decode_attention take them.
// For layer l: keys[l], values[l] its cache; projections[4l .. 4l + 3] its q, k and v fused, o, gate and
// up fused, and down, in blocks of bits[4l ..]; norms[1 + 2l] and norms[2 + 2l] the norms after its
// attention and after its MLP (the next layer's input norm, or the model's final one), norms[0] the
// first layer's input norm, each with its eps. Returns the final norm of the last layer's output.
at::Tensor decode_layers(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& rows, const at::Tensor& positions, std::vector<at::Tensor> keys,
                         std::vector<at::Tensor> values, const std::vector<at::Tensor>& projections,
                         const std::vector<int64_t>& bits, const std::vector<at::Tensor>& norms,
                         const std::vector<double>& eps, int64_t heads, int64_t kv_heads, double scaling) {
  const size_t layers = keys.size();
  TORCH_CHECK(values.size() == layers && projections.size() == 4 * layers && bits.size() == 4 * layers &&
                  norms.size() == 1 + 2 * layers && eps.size() == norms.size(),
              "decode_layers needs, for each layer, its cache, 4 projections and 2 norms (and one more norm)");
  const int64_t queries = hidden.size(0);
  at::Tensor normed = rms_norm(hidden, norms[0], eps[0]);
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* projection = &projections[4 * l];
    const int64_t* bit = &bits[4 * l];
    const at::Tensor qkv = block_matmul(normed, projection[0], bit[0]);
    const at::Tensor query = rotate_and_store(qkv, cos, sin, slots, keys[l], values[l], heads, kv_heads);
    const at::Tensor attended = decode_attention(query, keys[l], values[l], rows, positions, scaling, 0);
    const at::Tensor output = block_matmul(attended.view({queries, -1}).to(hidden.scalar_type()), projection[1], bit[1]);
    normed = add_rms_norm(hidden, output, norms[1 + 2 * l], eps[1 + 2 * l]);
    const at::Tensor gate_up = block_matmul(normed, projection[2], bit[2]);
    const at::Tensor down = block_matmul(silu_mul(gate_up), projection[3], bit[3]);
    normed = add_rms_norm(hidden, down, norms[2 + 2 * l], eps[2 + 2 * l]);
  }
  return normed;
}

}  // namespace fused_ops
