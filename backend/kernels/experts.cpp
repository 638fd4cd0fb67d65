// A mixture-of-experts layer of a decode step in one call: transformers' Qwen3-MoE, Mixtral and gpt-oss blocks as
// the decoder runner serves them (a float32 router, backend/layers/float_router.py; each expert's projections in
// blocks, backend/quant/quantized_experts.py), with the same ATen operations and kernels in the same order, so
// the same numbers bit for bit. What goes is Python's share: some thirty calls a layer through the interpreter
// and pybind at one row, about a fifth of a Qwen3-30B-A3B-shaped layer's time (docs/performance.md).
#include <ATen/ATen.h>

#include "fused_ops.h"

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

namespace fused_ops {

namespace {

// gpt-oss's activation as quantized_experts.ClampedSwiGLU computes it: gate and up interleaved, each clamped
// to `limit` (gate from above only), (up + 1) * gate * sigmoid(alpha gate).
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  const at::Tensor gate = at::clamp(gate_up.slice(-1, 0, std::nullopt, 2), std::nullopt, limit);
  const at::Tensor up = at::clamp(gate_up.slice(-1, 1, std::nullopt, 2), -limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

// One expert's activated gate and up projected down, for the rows of x.
at::Tensor expert_output(const at::Tensor& x, const Mixture& mixture, const std::vector<at::Tensor>& projections,
                         const std::vector<int64_t>& bits, const std::vector<int64_t>& tables, const Biases& biases,
                         size_t gate_up, size_t down) {
  const at::Tensor both = projected(x, projections, bits, tables, biases, gate_up);
  const at::Tensor hidden = mixture.limit > 0 ? clamped_swiglu(both, mixture.alpha, mixture.limit) : silu_mul(both);
  return projected(hidden, projections, bits, tables, biases, down);
}

// Each token's chosen experts and their weights, [tokens, top_k] each, as transformers' routers give them over
// float32 (FloatRouter's input and weights): Qwen3MoeTopKRouter's and MixtralTopKRouter's softmax, then top k,
// renormalized where asked; GptOssTopKRouter's top k of the logits, then their softmax.
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& router,
                                         const std::optional<at::Tensor>& router_bias, const Mixture& mixture) {
  const at::Tensor logits = at::linear(x.to(at::kFloat), router, router_bias);
  if (mixture.top_k_first) {
    auto [top, chosen] = at::topk(logits, mixture.top_k, -1);
    return {at::softmax(top, 1, at::kFloat), chosen};
  }
  auto [weights, chosen] = at::topk(at::softmax(logits, -1, at::kFloat), mixture.top_k, -1);
  if (mixture.normalize) weights.div_(weights.sum(-1, true));
  return {weights, chosen};
}

}  // namespace

// x: [tokens, hidden], the layer's normed input. router: [experts, hidden] float32, with its bias where it has
// one. The experts' projections from `first` on: each expert's gate and up (one projection), then each
// expert's down, in the order of their experts, each with its bias where `biases` (one a projection, or
// empty) has one. Routed as `route` says; then QuantizedExperts' forward: one token takes its experts in
// ascending order, each weighted output added in x's dtype (`one_token`); more tokens take each expert chosen
// by any of them, over its tokens (`by_masks`).
at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& router, const std::optional<at::Tensor>& router_bias,
                           const Mixture& mixture, const std::vector<at::Tensor>& projections,
                           const std::vector<int64_t>& bits, const std::vector<int64_t>& tables,
                           const Biases& biases, int64_t first) {
  const int64_t experts = router.size(0), tokens = x.size(0), top_k = mixture.top_k;
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1) &&
                  router.scalar_type() == at::kFloat,
              "experts_forward needs [tokens, hidden] rows and a float32 [experts, hidden] router");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "experts_forward needs 1 <= top_k <= experts");
  TORCH_CHECK(first >= 0 && static_cast<size_t>(first + 2 * experts) <= projections.size() &&
                  bits.size() == projections.size() && tables.size() == projections.size() &&
                  (biases.empty() || biases.size() == projections.size()),
              "experts_forward needs each expert's two projections, with their bits, tables (and biases)");
  const auto [weights, chosen] = route(x, router, router_bias, mixture);
  at::Tensor out = at::zeros_like(x);
  const auto gate_up = [&](int64_t expert) { return static_cast<size_t>(first + expert); };
  const auto down = [&](int64_t expert) { return static_cast<size_t>(first + experts + expert); };
  const auto output = [&](const at::Tensor& rows, int64_t expert) {
    return expert_output(rows, mixture, projections, bits, tables, biases, gate_up(expert), down(expert));
  };
  if (tokens == 1) {
    const at::Tensor ids = chosen[0].contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    std::vector<int64_t> slots(top_k);
    std::iota(slots.begin(), slots.end(), 0);
    std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    for (const int64_t slot : slots) {
      out.add_((output(x, id[slot]) * weights.slice(1, slot, slot + 1)).to(out.scalar_type()));
    }
    return out;
  }
  // [experts + 1, top_k, tokens], as transformers' one-hot (its last class, for a token sent to no expert,
  // is never chosen by a top k)
  const at::Tensor hits = at::one_hot(chosen, experts + 1).permute({2, 1, 0});
  const at::Tensor used = hits.slice(0, 0, experts).sum({-1, -2}).nonzero().flatten().contiguous();
  const int64_t* expert = used.data_ptr<int64_t>();
  for (int64_t i = 0; i < used.numel(); ++i) {
    const std::vector<at::Tensor> where = at::where(hits[expert[i]]);
    const at::Tensor& slot = where[0];
    const at::Tensor& token = where[1];
    const at::Tensor rows_out = output(x.index_select(0, token), expert[i]);
    out.index_add_(0, token, (rows_out * weights.index({token, slot}).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}

}  // namespace fused_ops
