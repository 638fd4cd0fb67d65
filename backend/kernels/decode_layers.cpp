// A decode step's layers in one call: DecoderRunner.decode_layers's loop (backend/model/decoder_runner.py), run
// in C++ where every projection is in blocks (block_weights.py) and every operation between them is one of
// this extension's loops. The same functions in the same order, so the same numbers bit for bit; what goes
// is Python's share of a one-row step: some ten calls a layer through the interpreter and pybind, about a
// millisecond of a 5.7 ms step of the default model (docs/performance.md).
#include <ATen/ATen.h>

#include "fused_ops.h"

#include <vector>

namespace fused_ops {

namespace {

// x times `count` projections from the `first`-th on, their outputs side by side.
at::Tensor project(const at::Tensor& x, const std::vector<at::Tensor>& projections, const std::vector<int64_t>& bits,
                   const std::vector<int64_t>& tables, const Biases& biases, size_t first, int64_t count) {
  if (count == 1) return projected(x, projections, bits, tables, biases, first);
  std::vector<at::Tensor> outputs;
  for (size_t i = first; i < first + count; ++i) outputs.push_back(projected(x, projections, bits, tables, biases, i));
  return at::cat(outputs, 1);
}

// x's RMSNorm (its LayerNorm where `centered`: Cohere's), or x itself where the weight is empty: a place
// where the layer norms nothing (OLMo 2's layers norm their sublayers' outputs, not their inputs).
at::Tensor norm_or_not(const at::Tensor& x, const at::Tensor& weight, double eps, bool centered) {
  return weight.numel() == 0 ? x : norm(x, weight, eps, centered);
}

// hidden += delta in place (as add_rms_norm adds), then as norm_or_not.
at::Tensor add_norm_or_not(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps,
                           bool centered) {
  if (weight.numel() > 0) return add_norm(hidden, delta, weight, eps, centered);
  hidden.add_(delta);
  return hidden;
}

}  // namespace

// x times projection i in blocks, plus its bias where it has one (WeightOnlyLinear's forward).
at::Tensor projected(const at::Tensor& x, const std::vector<at::Tensor>& projections, const std::vector<int64_t>& bits,
                     const std::vector<int64_t>& tables, const Biases& biases, size_t i) {
  const at::Tensor out = block_matmul(x, projections[i], bits[i], tables[i]);
  return biases.empty() || !biases[i].has_value() ? out : out + *biases[i];
}

// hidden: [queries, hidden] embeddings, this step's own (the residual adds write into it); cos[r], sin[r]:
// [queries, 1, head_dim], rotation r of the model's (Gemma 3 rotates its window and global layers apart),
// layer l's rotations[l] (all 0 where rotations is empty); windows[l] its sliding window (0 or empty: none);
// slots, rows, positions: as rotate_and_store and decode_attention take them.
// For layer l: keys[l], values[l] its cache; its projections next in `projections`, in blocks of the same
// place's bits (and tables[i]: the table its values index, or none): q, k and v in calls[2l] calls (one
// where they fused; a K-quant mix's Q4_K q and k beside its Q6_K v are two), o, gate and up in
// calls[2l + 1], and down; or, where calls[2l + 1] is 0, a mixture of experts (experts.cpp): after o each
// expert's gate and up, then each expert's down, routed by the next of `routers` (with the next of
// `router_biases`, where given) as `mixture` says (Qwen3-MoE's, Mixtral's, gpt-oss's); biases[i]
// projection i's bias where it has one (none where biases is empty); sinks[l] layer l's sink logits
// (gpt-oss's, none where sinks is empty or has none for it); norms[1 + 2l] and norms[2 + 2l] the norms
// after its attention and after its MLP (the next layer's input norm, or the model's final one), norms[0]
// the first layer's input norm, each with its eps; where `sandwich` (Gemma 3's and OLMo 2's layers), four
// a layer: the norm of its attention's output, the norm after the residual add, the norm of its MLP's
// output, the next layer's input norm; an empty norm is none (OLMo 2 norms no sublayer's input).
// head_norms[2l] and head_norms[2l + 1] its norms of each query and key head, or of its queries and its
// keys whole (Qwen3's and Gemma 3's, OLMo 2's), with head_eps, or none for every layer (head_norms empty).
// The MLP's activation GELU's tanh approximation where `gelu` (Gemma's), else SiLU; or where `squared_relu`
// (Arcee's MLP, which has no gate: its gate_up calls are its up's) ReLU(up)^2, PyTorch's two operations.
// Each sublayer's output is multiplied by `residual` before its residual add (Granite's
// residual_multiplier; 1: not at all).
// Attention's scores are soft-capped at `softcap` (Gemma 2's; 0: not at all). Queries and keys rotate in
// neighbouring pairs where `interleaved` (GLM's, ERNIE 4.5's, Helium's: rotate_and_store). Every norm is a
// LayerNorm without a bias where `centered` (Cohere's), else an RMSNorm. Where `parallel` (Cohere's layers)
// the MLP takes the layer's input norm as attention does, both outputs added to the residual, attention's
// first (no norm between: its norms[1 + 2l] is empty). Each rotated query is multiplied by its
// query_scales[q], in the queries' dtype, where that is not empty (Ministral 3's). Where conv_states[l] is not
// empty (LFM2's convolution layers; conv_states empty: none), layer l is a short convolution in place of
// attention: its q, k and v calls are its in_proj's (B, C and x), its o its out_proj, between them
// short_conv over conv_states[l] (its rows' last inputs, advanced in place) with conv_weights[l] and
// conv_biases[l] (none where empty); such a layer has no head norms (empty ones). Returns the final norm of
// the last layer's output.
at::Tensor decode_layers(at::Tensor hidden, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         const at::Tensor& slots,
                         const at::Tensor& rows, const at::Tensor& positions, std::vector<at::Tensor> keys,
                         std::vector<at::Tensor> values, const std::vector<at::Tensor>& projections,
                         const std::vector<int64_t>& bits, const std::vector<int64_t>& tables,
                         const std::vector<int64_t>& calls, const std::vector<at::Tensor>& norms,
                         const std::vector<double>& eps, const std::vector<at::Tensor>& head_norms,
                         const std::vector<double>& head_eps, int64_t heads, int64_t kv_heads, double scaling,
                         const Biases& biases, const std::vector<at::Tensor>& routers, const Biases& router_biases,
                         const Mixture& mixture, const std::vector<int64_t>& rotations,
                         const std::vector<int64_t>& windows, const Biases& sinks, bool sandwich, bool gelu,
                         bool squared_relu, double residual, double softcap, bool interleaved, bool centered,
                         bool parallel, const at::Tensor& query_scales, const std::vector<at::Tensor>& conv_states,
                         const std::vector<at::Tensor>& conv_weights, const Biases& conv_biases) {
  const size_t layers = keys.size(), layer_norms = sandwich ? 4 : 2;
  TORCH_CHECK(values.size() == layers && calls.size() == 2 * layers && norms.size() == 1 + layer_norms * layers &&
                  eps.size() == norms.size(),
              "decode_layers needs, for each layer, its cache, its calls' counts and 2 norms (4 for a sandwich), "
              "and one more norm");
  TORCH_CHECK(!cos.empty() && sin.size() == cos.size(), "decode_layers needs a rotation's cos and sin at least");
  TORCH_CHECK(rotations.empty() || rotations.size() == layers, "decode_layers needs a rotation a layer, or none");
  for (const int64_t rotation : rotations) {
    TORCH_CHECK(rotation >= 0 && static_cast<size_t>(rotation) < cos.size(), "a layer's rotation is out of range");
  }
  TORCH_CHECK(windows.empty() || windows.size() == layers, "decode_layers needs a window a layer, or none");
  TORCH_CHECK(sinks.empty() || sinks.size() == layers, "decode_layers needs each layer's sinks, or none");
  TORCH_CHECK(conv_states.empty() || (conv_states.size() == layers && conv_weights.size() == layers),
              "decode_layers needs each layer's convolution states and weights (empty: attention), or none");
  TORCH_CHECK(conv_biases.empty() || conv_biases.size() == layers, "decode_layers needs each convolution's bias, or none");
  TORCH_CHECK(router_biases.empty() || router_biases.size() == routers.size(),
              "decode_layers needs each router's bias, or none");
  TORCH_CHECK((head_norms.empty() || head_norms.size() == 2 * layers) && head_eps.size() == head_norms.size(),
              "decode_layers needs 2 head norms a layer, with their eps, or none");
  size_t projection_count = 0, mixtures = 0;
  for (size_t l = 0; l < layers; ++l) {
    TORCH_CHECK(calls[2 * l] >= 1 && calls[2 * l + 1] >= 0, "a layer's q, k and v take a call at least");
    if (calls[2 * l + 1] > 0) {
      projection_count += calls[2 * l] + calls[2 * l + 1] + 2;
    } else {
      TORCH_CHECK(mixtures < routers.size(), "decode_layers needs a router for each mixture of experts");
      projection_count += calls[2 * l] + 1 + 2 * routers[mixtures++].size(0);
    }
  }
  TORCH_CHECK(mixtures == routers.size(), "decode_layers needs a router for each mixture of experts alone");
  TORCH_CHECK(projections.size() == projection_count && bits.size() == projection_count &&
                  tables.size() == projection_count,
              "decode_layers needs the projections its calls' counts say, and their bits and tables");
  TORCH_CHECK(biases.empty() || biases.size() == projection_count, "decode_layers needs each projection's bias, or none");
  const int64_t queries = hidden.size(0);
  TORCH_CHECK(!parallel || !sandwich, "a parallel layer has no norms of its sublayers' outputs");
  TORCH_CHECK(query_scales.numel() == 0 || query_scales.numel() == hidden.size(0), "a query scale a query, or none");
  at::Tensor normed = norm_or_not(hidden, norms[0], eps[0], centered);
  size_t next = 0, mixture_index = 0;  // the layer's first projection, the next mixture's router
  for (size_t l = 0; l < layers; ++l) {
    const int64_t qkv_calls = calls[2 * l], gate_up_calls = calls[2 * l + 1];
    const size_t o = next + qkv_calls, gate_up_first = o + 1, down = gate_up_first + gate_up_calls;
    at::Tensor qkv = project(normed, projections, bits, tables, biases, next, qkv_calls);
    const size_t norm = 1 + layer_norms * l;
    at::Tensor mixed;  // what the layer's o (a convolution layer's out_proj) takes
    if (!conv_states.empty() && conv_states[l].numel() > 0) {
      at::Tensor states = conv_states[l];
      mixed = short_conv(states, qkv, rows, conv_weights[l], conv_biases.empty() ? std::nullopt : conv_biases[l]);
    } else {
      if (!head_norms.empty() && head_norms[2 * l].numel() > 0) {
        head_rms_norms(qkv, head_norms[2 * l], head_norms[2 * l + 1], heads, kv_heads, head_eps[2 * l],
                       head_eps[2 * l + 1]);
      }
      const size_t rotation = rotations.empty() ? 0 : rotations[l];
      at::Tensor query = rotate_and_store(qkv, cos[rotation], sin[rotation], slots, keys[l], values[l], heads,
                                          kv_heads, interleaved);
      if (query_scales.numel() > 0) query = query * query_scales.view({-1, 1, 1});  // (the Python loop's product)
      const at::Tensor attended = decode_attention(query, keys[l], values[l], rows, positions, scaling,
                                                   windows.empty() ? 0 : windows[l],
                                                   sinks.empty() ? std::nullopt : sinks[l], softcap);
      mixed = attended.view({queries, -1}).to(hidden.scalar_type());
    }
    at::Tensor output = project(mixed, projections, bits, tables, biases, o, 1);
    if (sandwich) output = norm_or_not(output, norms[norm], eps[norm], centered);
    if (residual != 1.0) output = output * residual;  // (PyTorch's product by a number: the Python loop's)
    const size_t mlp_norm = sandwich ? norm + 1 : norm;  // (after the attention output's own, if it has one)
    if (parallel) {
      hidden.add_(output);  // (the MLP's input is the attention's, `normed` as it is)
    } else {
      normed = add_norm_or_not(hidden, output, norms[mlp_norm], eps[mlp_norm], centered);
    }
    at::Tensor mlp;
    if (gate_up_calls > 0) {
      const at::Tensor gate_up = project(normed, projections, bits, tables, biases, gate_up_first, gate_up_calls);
      const at::Tensor activated = squared_relu ? at::square(at::relu(gate_up)) : gelu ? gelu_tanh_mul(gate_up)
                                                                                    : silu_mul(gate_up);
      mlp = project(activated, projections, bits, tables, biases, down, 1);
      next = down + 1;
    } else {
      const at::Tensor& router = routers[mixture_index];
      mlp = experts_forward(normed, router, router_biases.empty() ? std::nullopt : router_biases[mixture_index],
                            mixture, projections, bits, tables, biases, static_cast<int64_t>(gate_up_first));
      next = gate_up_first + 2 * router.size(0);
      ++mixture_index;
    }
    if (sandwich) mlp = norm_or_not(mlp, norms[norm + 2], eps[norm + 2], centered);
    if (residual != 1.0) mlp = mlp * residual;
    const size_t next_norm = norm + layer_norms - 1;
    normed = add_norm_or_not(hidden, mlp, norms[next_norm], eps[next_norm], centered);
  }
  return normed;
}

}  // namespace fused_ops
