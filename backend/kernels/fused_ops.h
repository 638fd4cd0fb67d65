// The C++ extension's functions that its files call one another by (fused_ops.cpp, block_matmul.cpp,
// decode_layers.cpp, experts.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace fused_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps);
// Either, by `centered`: a LayerNorm without a bias where true (Cohere's), else an RMSNorm
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool centered);
at::Tensor add_norm(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps, bool centered);
at::Tensor head_rms_norms(at::Tensor& qkv, const at::Tensor& query_weight, const at::Tensor& key_weight,
                          int64_t heads, int64_t kv_heads, double query_eps, double key_eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& slots, at::Tensor& keys, at::Tensor& values, int64_t heads,
                            int64_t kv_heads, bool interleaved);
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rows, const at::Tensor& positions, double scaling, int64_t window,
                            const std::optional<at::Tensor>& sinks, double softcap);
bool attention_supports(int64_t head_dim, int64_t group);

std::string block_matmul_kernel();
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weights, int64_t bits, int64_t table);
at::Tensor block_matmul_avx2(const at::Tensor& x, const at::Tensor& weights, int64_t bits, int64_t table);
void block_dequantize(const at::Tensor& weights, int64_t bits, int64_t table, at::Tensor& out);
void block_rows(const at::Tensor& weights, int64_t bits, int64_t table, const at::Tensor& ids, at::Tensor& out);

// How a mixture of experts routes a token and activates its experts (experts.cpp): Qwen3-MoE's and Mixtral's
// softmax of the router's logits, then its top k, renormalized where `normalize`, and SiLU(gate) * up; or
// gpt-oss's top k of the logits, then their softmax (`top_k_first`), and its SwiGLU clamped to `limit`
// (where `limit` > 0), gate and up interleaved.
struct Mixture {
  int64_t top_k = 0;
  bool normalize = false;
  bool top_k_first = false;
  double alpha = 0, limit = 0;
};

using Biases = std::vector<std::optional<at::Tensor>>;

at::Tensor projected(const at::Tensor& x, const std::vector<at::Tensor>& projections, const std::vector<int64_t>& bits,
                     const std::vector<int64_t>& tables, const Biases& biases, size_t i);

at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& router, const std::optional<at::Tensor>& router_bias,
                           const Mixture& mixture, const std::vector<at::Tensor>& projections,
                           const std::vector<int64_t>& bits, const std::vector<int64_t>& tables,
                           const Biases& biases, int64_t first);

at::Tensor decode_layers(at::Tensor hidden, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         const at::Tensor& slots,
                         const at::Tensor& rows, const at::Tensor& positions, std::vector<at::Tensor> keys,
                         std::vector<at::Tensor> values, const std::vector<at::Tensor>& projections,
                         const std::vector<int64_t>& bits, const std::vector<int64_t>& tables,
                         const std::vector<int64_t>& calls,
                         const std::vector<at::Tensor>& norms,
                         const std::vector<double>& eps, const std::vector<at::Tensor>& head_norms,
                         const std::vector<double>& head_eps, int64_t heads, int64_t kv_heads, double scaling,
                         const Biases& biases, const std::vector<at::Tensor>& routers, const Biases& router_biases,
                         const Mixture& mixture, const std::vector<int64_t>& rotations,
                         const std::vector<int64_t>& windows, const Biases& sinks, bool sandwich, bool gelu,
                         bool squared_relu, double residual, double softcap, bool interleaved, bool centered,
                         bool parallel, const at::Tensor& query_scales, const std::vector<at::Tensor>& conv_states,
                         const std::vector<at::Tensor>& conv_weights, const Biases& conv_biases);
at::Tensor short_conv(at::Tensor& states, const at::Tensor& projected, const at::Tensor& rows, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);

}  // namespace fused_ops
