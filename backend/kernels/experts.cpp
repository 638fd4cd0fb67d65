// A mixture-of-experts layer of a decode step in one call: transformers' Qwen3-MoE and Mixtral blocks as the
// decoder runner serves them (a float32 router, backend/layers/float_router.py; each expert's projections in
// blocks, backend/quant/quantized_experts.py), with the same ATen operations and kernels in the same order, so
// the same numbers bit for bit. What goes is Python's share: some thirty calls a layer through the interpreter
// and pybind at one row, about a fifth of a Qwen3-30B-A3B-shaped layer's time (docs/performance.md).
#include <ATen/ATen.h>

#include "fused_ops.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace fused_ops {

namespace {

// One expert's act(gate) * up projected down, for the rows of x: QuantizedExperts' gate_up, PlainGLU's SiLU
// (the extension's loop) and down.
at::Tensor expert_output(const at::Tensor& x, const std::vector<at::Tensor>& projections,
                         const std::vector<int64_t>& bits, const std::vector<int64_t>& tables, size_t gate_up,
                         size_t down) {
  const at::Tensor hidden = silu_mul(block_matmul(x, projections[gate_up], bits[gate_up], tables[gate_up]));
  return block_matmul(hidden, projections[down], bits[down], tables[down]);
}

}  // namespace

// x: [tokens, hidden], the layer's normed input. router: [experts, hidden] float32. The experts' projections
// from `first` on: each expert's gate and up (one projection), then each expert's down, in the order of
// their experts. Routing as transformers' Qwen3MoeTopKRouter and MixtralTopKRouter give it over float32:
// softmax of the logits, the top `top_k`, divided by their sum where `normalize`. Then QuantizedExperts'
// forward: one token takes its experts in ascending order, each weighted output added in x's dtype
// (`one_token`); more tokens take each expert chosen by any of them, over its tokens (`by_masks`).
at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool normalize,
                           const std::vector<at::Tensor>& projections, const std::vector<int64_t>& bits,
                           const std::vector<int64_t>& tables, int64_t first) {
  const int64_t experts = router.size(0), tokens = x.size(0);
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1) &&
                  router.scalar_type() == at::kFloat,
              "experts_forward needs [tokens, hidden] rows and a float32 [experts, hidden] router");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "experts_forward needs 1 <= top_k <= experts");
  TORCH_CHECK(first >= 0 && static_cast<size_t>(first + 2 * experts) <= projections.size() &&
                  bits.size() == projections.size() && tables.size() == projections.size(),
              "experts_forward needs each expert's two projections, with their bits and tables");
  const at::Tensor probabilities = at::softmax(at::linear(x.to(at::kFloat), router), -1, at::kFloat);
  auto [weights, chosen] = at::topk(probabilities, top_k, -1);
  if (normalize) weights.div_(weights.sum(-1, true));
  at::Tensor out = at::zeros_like(x);
  const auto gate_up = [&](int64_t expert) { return static_cast<size_t>(first + expert); };
  const auto down = [&](int64_t expert) { return static_cast<size_t>(first + experts + expert); };
  if (tokens == 1) {
    const at::Tensor ids = chosen[0].contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    std::vector<int64_t> slots(top_k);
    std::iota(slots.begin(), slots.end(), 0);
    std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    for (const int64_t slot : slots) {
      const at::Tensor output = expert_output(x, projections, bits, tables, gate_up(id[slot]), down(id[slot]));
      out.add_((output * weights.slice(1, slot, slot + 1)).to(out.scalar_type()));
    }
    return out;
  }
  // [experts + 1, top_k, tokens], as transformers' one-hot (its last class, for a token sent to no expert,
  // is never chosen by a softmax's top k)
  const at::Tensor hits = at::one_hot(chosen, experts + 1).permute({2, 1, 0});
  const at::Tensor used = hits.slice(0, 0, experts).sum({-1, -2}).nonzero().flatten().contiguous();
  const int64_t* expert = used.data_ptr<int64_t>();
  for (int64_t i = 0; i < used.numel(); ++i) {
    const std::vector<at::Tensor> where = at::where(hits[expert[i]]);
    const at::Tensor& slot = where[0];
    const at::Tensor& token = where[1];
    const at::Tensor output = expert_output(x.index_select(0, token), projections, bits, tables,
                                            gate_up(expert[i]), down(expert[i]));
    out.index_add_(0, token, (output * weights.index({token, slot}).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}

}  // namespace fused_ops
