"""A mixture of experts' weights in the weight-only layers' blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
Gemma 4, LFM2-MoE, gpt-oss, and twenty-eight other served families whose experts' module is Qwen3-MoE's:
`PLAIN_EXPERTS`).

transformers keeps every expert of a layer in two float tensors, `gate_up_proj` [experts, 2 x
intermediate, hidden] and `down_proj` [experts, hidden, intermediate], and multiplies each token by its
chosen experts' slices. Those tensors are nearly all of an MoE model's weights (Qwen3-30B-A3B: 29 of
30 B), so `--quantize int4|int8` left an MoE model about as large as before, and each decode step read
the chosen experts in bfloat16. `QuantizedExperts` takes their place: one weight-only layer
(quantized_linear.py) an expert and projection, the same routing as transformers' module. A decode
step sends a few tokens to each chosen expert, so the layers keep no dense copy for many rows: an
expert's copy would cost four times its 4-bit weights, and blocks multiply a prompt's tokens as fast
(quantized_linear.py). gpt-oss's experts differ: each projection is stored [in, out] (x @ W) with a
bias, gate and up interleaved (gate j in column 2j, up j in 2j + 1), and their activation is clamped,
(clamp(up) + 1) * g * sigmoid(alpha g) with g = clamp(gate); their layers take the transposed slices
and the biases, and `ClampedSwiGLU` the activation. Llama 4's store theirs [in, out] too, without biases,
and its mixture multiplies every token by every expert, its input scaled by the expert's score (zero
where not chosen): `Llama4Mixture` takes its place, each token multiplied by its chosen experts alone.
Other experts' modules stay floats (`takes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from backend.kernels import extension as kernels
from backend.quant.quantized_linear import WeightOnlyLinear, fits_int4_kernels

# The experts' modules whose forward is transformers' plain one (above), by class name: their parameters,
# forward and routing arguments are Qwen3-MoE's line for line (tests/backend/test_quantized_experts.py
# holds each served family's to it), whatever routes to them (a softmax, a sigmoid with a correction,
# groups of experts, a shared expert beside them).
PLAIN_EXPERTS = {
    "Qwen3MoeExperts",
    "Qwen2MoeExperts",
    "MixtralExperts",
    "OlmoeExperts",
    "Gemma4TextExperts",
    "Lfm2MoeExperts",
    "Qwen3NextExperts",
    "Qwen3_5MoeExperts",
    "Ernie4_5_MoeExperts",
    "Glm4MoeExperts",
    "Glm4MoeLiteExperts",
    "DeepseekV2Experts",
    "DeepseekV3Experts",
    "MiniMaxM2Experts",
    "HunYuanMoEV1Experts",
    "PhimoeExperts",
    "GraniteMoeExperts",
    "GraniteMoeSharedExperts",
    "GraniteMoeHybridExperts",
    "GraniteMoeSWAExperts",
    "JambaExperts",
    "SolarOpenExperts",
    "ExaoneMoeExperts",
    "AfmoeExperts",
    "LagunaExperts",
    "Cohere2MoeExperts",
    "FlexOlmoExperts",
    "HYV3Experts",
    "MellumExperts",
    "FlintExperts",
    "Kolibri1Experts",
    "DeepseekV32Experts",
    "GlmMoeDsaExperts",
    "AXK1Experts",
}
GPT_OSS_EXPERTS = "GptOssExperts"  # [in, out] weights, biases, gate and up interleaved, clamped
LLAMA4_EXPERTS = "Llama4TextExperts"  # [in, out] weights, gate and up halves (`Llama4Mixture` routes)
PARTS = ("gate_up", "down")


def takes(module: nn.Module) -> bool:
    """Whether `module` is an experts' module of a kind served here whose projections the kernels take."""
    if type(module).__name__ not in (*PLAIN_EXPERTS, GPT_OSS_EXPERTS, LLAMA4_EXPERTS):
        return False
    return all(fits_int4_kernels(as_linear(expert_weight(module, part, 0))) for part in PARTS)


def is_gpt_oss(module: nn.Module) -> bool:
    return type(module).__name__ == GPT_OSS_EXPERTS


def expert_weight(module: nn.Module, part: str, expert: int) -> torch.Tensor:
    """Expert `expert`'s weight of projection `part` ("gate_up" or "down") as [out, in] (a view)."""
    weight = getattr(module, f"{part}_proj")[expert]
    return weight.T if is_gpt_oss(module) or type(module).__name__ == LLAMA4_EXPERTS else weight


def expert_bias(module: nn.Module, part: str, expert: int) -> torch.Tensor | None:
    """Its bias (gpt-oss's), a copy: the module's stacked biases go with it."""
    bias = getattr(module, f"{part}_proj_bias", None)
    return None if bias is None else bias[expert].detach().clone()


def as_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An expert's [out, in] slice as a linear layer over it, for the quantizers: no copy (a copy of a
    transposed slice of an MXFP4 checkpoint's placeholders would make floats the model never held)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return linear


class PlainGLU(nn.Module):
    """act(gate) * up, gate and up the two halves of an expert's gate_up output; SiLU's on a CPU by the
    C++ extension's loop (`silu_mul`, one rounding where PyTorch's three operations round after each):
    a one-row step calls it for every chosen expert of every layer."""

    def __init__(self, act_fn: nn.Module):
        super().__init__()
        self.act_fn = act_fn
        self.silu = type(act_fn).__name__ in ("SiLU", "SiLUActivation")

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.silu and gate_up.is_cpu and gate_up.is_contiguous():
            built = kernels.extension()
            if built is not None:
                return built.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's activation, as transformers' GptOssExperts computes it: gate and up interleaved, each
    clamped to `limit` (gate from above only), (up + 1) * gate * sigmoid(alpha gate)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def activation_of(experts: nn.Module) -> nn.Module:
    """The activation between an experts' module's gate_up and down projections (its floats not kept)."""
    if is_gpt_oss(experts):
        return ClampedSwiGLU(float(experts.alpha), float(experts.limit))
    return PlainGLU(experts.act_fn)


class QuantizedExperts(nn.Module):
    """transformers' experts' module with each expert's projections a weight-only layer."""

    def __init__(self, experts: nn.Module, gate_up: list[WeightOnlyLinear], down: list[WeightOnlyLinear]):
        """`experts` (transformers' module) served by these layers, one an expert each, without their
        dense copies."""
        super().__init__()
        self.num_experts = experts.num_experts
        self.activation = activation_of(experts)
        self.gate_up = nn.ModuleList(without_copy(layer) for layer in gate_up)
        self.down = nn.ModuleList(without_copy(layer) for layer in down)
        self.bound: dict[torch.dtype, tuple[list[Callable], list[Callable]]] = {}  # `few_rows`

    @classmethod
    def quantized(
        cls, experts: nn.Module, quantize: Callable[[nn.Linear], WeightOnlyLinear]
    ) -> QuantizedExperts:
        """`experts`' weights quantized by `quantize` (QUANTIZERS' int4 or int8)."""
        layers = {
            part: [
                quantize(as_linear(expert_weight(experts, part, e), expert_bias(experts, part, e)))
                for e in range(experts.num_experts)
            ]
            for part in PARTS
        }
        return cls(experts, **layers)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [tokens, hidden]
        top_k_index: torch.Tensor,  # [tokens, top_k]: each token's chosen experts
        top_k_weights: torch.Tensor,  # [tokens, top_k]: their weights
    ) -> torch.Tensor:
        """The weighted sum of each token's chosen experts' outputs, as transformers' module computes it."""
        if hidden_states.shape[0] == 1:
            return self.one_token(hidden_states, top_k_index, top_k_weights)
        return self.by_masks(hidden_states, top_k_index, top_k_weights)

    def by_masks(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """`forward` as transformers' module runs it: each expert chosen by any token, over those tokens."""
        out = torch.zeros_like(hidden_states)
        # (transformers' class: index num_experts is a token sent to no expert here)
        chosen = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert in chosen[: self.num_experts].sum(dim=(-1, -2)).nonzero().flatten().tolist():
            slot, token = torch.where(chosen[expert])
            hidden = self.activation(self.gate_up[expert](hidden_states[token]))
            expert_out = self.down[expert](hidden) * top_k_weights[token, slot, None]
            out.index_add_(0, token, expert_out.to(out.dtype))
        return out

    def one_token(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """`forward` for one token (a one-row decode step): its chosen experts read off at once, in the
        order the masks give them (ascending), each output weighted and added in the same dtypes; the
        same numbers without the masks, gathers and scatters around each expert, which took about a
        tenth of a one-row step of Qwen3-30B-A3B's shape (8 experts a token)."""
        gate_up, down = self.few_rows(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        experts = top_k_index[0].tolist()
        for slot in sorted(range(len(experts)), key=experts.__getitem__):
            expert = experts[slot]
            if expert >= self.num_experts:  # (transformers' index for no expert)
                continue
            hidden = self.activation(gate_up[expert](hidden_states))
            out += (down[expert](hidden) * top_k_weights[:, slot, None]).to(out.dtype)
        return out

    def _apply(self, fn, recurse: bool = True):
        self.bound = {}  # (moved or cast: the bound functions would hold the weights as they were)
        return super()._apply(fn, recurse)

    def few_rows(self, dtype: torch.dtype) -> tuple[list[Callable], list[Callable]]:
        """Each expert's projections as functions of a few rows in `dtype` (`few_rows_matmul`: the kernel
        with its weights bound, the module's call and checks left out: a fifth of a one-token layer's
        time at Qwen3-30B-A3B's shape), made once for each dtype."""
        if dtype not in self.bound:
            self.bound[dtype] = tuple(
                [layer.few_rows_matmul(dtype) for layer in layers] for layers in (self.gate_up, self.down)
            )
        return self.bound[dtype]


def without_copy(layer: WeightOnlyLinear) -> WeightOnlyLinear:
    """The layer without its dense copy for many rows (see the module's docstring)."""
    layer.dense = None
    return layer


class Llama4Mixture(nn.Module):
    """Llama 4's mixture of experts (transformers' `Llama4TextMoe`) over its experts quantized
    (`QuantizedExperts`) or as floats (`SlicedExperts`): the same router and shared expert, each token
    multiplied by its chosen experts alone. transformers' module multiplies every token by every expert,
    the input scaled by the expert's score (the sigmoid of its logit where chosen, else 0, whose output is
    then 0) and the outputs summed: Scout's 16 experts' products for each token's one. Here each chosen
    expert's input is scaled so, its output weighted by 1."""

    def __init__(self, block: nn.Module, experts: nn.Module):
        super().__init__()
        self.top_k, self.hidden_dim = block.top_k, block.hidden_dim
        self.router, self.shared_expert, self.experts = block.router, block.shared_expert, experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([tokens, hidden], the router's logits), as transformers' module gives them."""
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden)  # [tokens, experts]
        chosen = torch.topk(logits, self.top_k, dim=1).indices  # (the router's own choice)
        weights = scores.gather(1, chosen)
        unweighted = torch.ones_like(weights[:, :1])
        out = self.shared_expert(hidden)
        for slot in range(self.top_k):  # (Scout's and Maverick's: one)
            out.add_(self.experts(hidden * weights[:, slot, None], chosen[:, slot, None], unweighted))
        return out, logits


class SlicedExperts(nn.Module):
    """Llama 4's float experts (`Llama4TextExperts`: [experts, in, out] tensors) called as `QuantizedExperts`
    are, with the tokens, each one's chosen experts and their weights: each chosen expert's slices multiply
    its tokens alone, as transformers' module multiplies an expert's (gate and up in halves, act(gate) *
    up, then down)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        # the tensors, not the module (which `quantize_experts` would take for a mixture's)
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.act_fn = experts.act_fn

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            gate, up = (hidden_states[token] @ self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = (up * self.act_fn(gate)) @ self.down_proj[expert]
            out.index_add_(0, token, (expert_out * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def route_llama4_mixtures(model: nn.Module) -> int:
    """Replace each of Llama 4's float mixtures (transformers' `Llama4TextMoe`) by `Llama4Mixture` over
    `SlicedExperts` (quantized ones are already: `quantize_experts`); returns how many."""
    blocks = [
        (name, module) for name, module in model.named_modules() if type(module).__name__ == "Llama4TextMoe"
    ]
    for name, block in blocks:
        owner, _, child = name.rpartition(".")
        setattr(model.get_submodule(owner), child, Llama4Mixture(block, SlicedExperts(block.experts)))
    return len(blocks)


def quantize_experts(model: nn.Module, quantize: Callable[[nn.Linear], WeightOnlyLinear]) -> int:
    """Replace every plain experts' module by its quantized version (and Llama 4's mixture by
    `Llama4Mixture`); returns the layers made (two an expert)."""
    made = 0
    for name, module in list(model.named_modules()):
        if takes(module):
            parent, _, child = name.rpartition(".")
            block = model.get_submodule(parent)
            quantized = QuantizedExperts.quantized(module, quantize)
            if type(module).__name__ == LLAMA4_EXPERTS:
                owner, _, block_name = parent.rpartition(".")
                setattr(model.get_submodule(owner), block_name, Llama4Mixture(block, quantized))
            else:
                setattr(block, child, quantized)
            made += 2 * module.num_experts
    return made
