"""A mixture of experts' weights in the weight-only layers' blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
Gemma 4, LFM2-MoE).

transformers keeps every expert of a layer in two float tensors, `gate_up_proj` [experts, 2 x
intermediate, hidden] and `down_proj` [experts, hidden, intermediate], and multiplies each token by its
chosen experts' slices. Those tensors are nearly all of an MoE model's weights (Qwen3-30B-A3B: 29 of
30 B), so `--quantize int4|int8` left an MoE model about as large as before, and each decode step read
the chosen experts in bfloat16. `QuantizedExperts` takes their place: one weight-only layer
(quantized_linear.py) an expert and projection, the same routing as transformers' module. A decode
step sends a few tokens to each chosen expert, so the layers keep no dense copy for many rows: an
expert's copy would cost four times its 4-bit weights, and blocks multiply a prompt's tokens as fast
(quantized_linear.py). Only the experts' module shape above is taken (`takes`); others (gpt-oss's,
with biases and a clamped activation) stay floats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from backend.quant.quantized_linear import WeightOnlyLinear, fits_int4_kernels

# The experts' modules whose forward is transformers' plain one (above), by class name.
PLAIN_EXPERTS = {
    "Qwen3MoeExperts",
    "Qwen2MoeExperts",
    "MixtralExperts",
    "OlmoeExperts",
    "Gemma4TextExperts",
    "Lfm2MoeExperts",
}


def takes(module: nn.Module) -> bool:
    """Whether `module` is an experts' module of the plain kind whose projections the kernels take."""
    if type(module).__name__ not in PLAIN_EXPERTS:
        return False
    return fits_int4_kernels(as_linear(module.gate_up_proj[0])) and fits_int4_kernels(
        as_linear(module.down_proj[0])
    )


def as_linear(weight: torch.Tensor) -> nn.Linear:
    """An expert's [out, in] slice as a bias-free linear layer over it (no copy), for the quantizers."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class QuantizedExperts(nn.Module):
    """transformers' experts' module with each expert's projections a weight-only layer."""

    def __init__(self, experts: nn.Module, gate_up: list[WeightOnlyLinear], down: list[WeightOnlyLinear]):
        """`experts` (transformers' module) served by these layers, one an expert each, without their
        dense copies."""
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.gate_up = nn.ModuleList(without_copy(layer) for layer in gate_up)
        self.down = nn.ModuleList(without_copy(layer) for layer in down)

    @classmethod
    def quantized(
        cls, experts: nn.Module, quantize: Callable[[nn.Linear], WeightOnlyLinear]
    ) -> QuantizedExperts:
        """`experts`' weights quantized by `quantize` (QUANTIZERS' int4 or int8)."""
        gate_up = [quantize(as_linear(weight)) for weight in experts.gate_up_proj]
        return cls(experts, gate_up, [quantize(as_linear(weight)) for weight in experts.down_proj])

    def forward(
        self,
        hidden_states: torch.Tensor,  # [tokens, hidden]
        top_k_index: torch.Tensor,  # [tokens, top_k]: each token's chosen experts
        top_k_weights: torch.Tensor,  # [tokens, top_k]: their weights
    ) -> torch.Tensor:
        """The weighted sum of each token's chosen experts' outputs, as transformers' module computes it."""
        out = torch.zeros_like(hidden_states)
        # (transformers' class: index num_experts is a token sent to no expert here)
        chosen = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert in chosen[: self.num_experts].sum(dim=(-1, -2)).nonzero().flatten().tolist():
            slot, token = torch.where(chosen[expert])
            gate, up = self.gate_up[expert](hidden_states[token]).chunk(2, dim=-1)
            expert_out = self.down[expert](self.act_fn(gate) * up) * top_k_weights[token, slot, None]
            out.index_add_(0, token, expert_out.to(out.dtype))
        return out


def without_copy(layer: WeightOnlyLinear) -> WeightOnlyLinear:
    """The layer without its dense copy for many rows (see the module's docstring)."""
    layer.dense = None
    return layer


def quantize_experts(model: nn.Module, quantize: Callable[[nn.Linear], WeightOnlyLinear]) -> int:
    """Replace every plain experts' module by its quantized version; returns the layers made (two an
    expert)."""
    made = 0
    for name, module in list(model.named_modules()):
        if takes(module):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, QuantizedExperts.quantized(module, quantize))
            made += 2 * module.num_experts
    return made
