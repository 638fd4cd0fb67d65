"""A mixture of experts' router with its logits in float32, on a CPU.

transformers' routers (Qwen3-MoE's, Mixtral's, gpt-oss's `...TopKRouter`) start with
`F.linear(hidden_states, self.weight)` in the model's dtype. In bfloat16 on a CPU, PyTorch's product
of one row by a router's [experts, hidden] weight is slow for its size: 48 us for Qwen3-30B-A3B's
128 x 2,048 where float32 takes 14, and 60-150 us inside a decode step, a twentieth of a one-row step
of that shape. llama.cpp keeps routers in float32 too. `FloatRouter` holds float32 copies of a
router's weight and bias (a megabyte a layer) and hands it its input in float32: the rest of the
router (softmax, top-k, renormalizing) then runs in float32 as well, and gives float32 weights for
the experts, which each expert's output is multiplied by before it is rounded to the model's dtype.
The same routing, rounded less.
"""

from __future__ import annotations

import torch
from torch import nn

# Where a mixture-of-experts block keeps its router: Qwen3-MoE's and Mixtral's `gate`, gpt-oss's `router`
ROUTER_NAMES = ("gate", "router")


class FloatRouter(nn.Module):
    """`router` computing in float32: its weight and bias float32 copies, its input cast."""

    def __init__(self, router: nn.Module):
        super().__init__()
        for name in ("weight", "bias"):
            tensor = getattr(router, name, None)
            if tensor is not None:
                setattr(router, name, nn.Parameter(tensor.detach().float(), requires_grad=False))
        self.router = router

    def forward(self, hidden_states: torch.Tensor, *args: torch.Tensor):
        """The router's output on the input in float32 (and what else its block hands it: MiniMax-M2's
        correction of its scores)."""
        return self.router(hidden_states.float(), *args)


def routers_in_float32(blocks: list[nn.Module]) -> int:
    """Wrap the router of each of the layers' MLP blocks on a CPU (a mixture of experts' block, or a dense
    MLP, which has none) whose weight is in a 16-bit dtype in a `FloatRouter` (once: a model served by
    several runners keeps its wrapped ones); returns how many are float32 routers now."""
    count = 0
    for block in blocks:
        for name in ROUTER_NAMES:
            router = getattr(block, name, None)
            if isinstance(router, FloatRouter):
                count += 1
            elif takes(router):
                setattr(block, name, FloatRouter(router))
                count += 1
    return count


def takes(router: nn.Module | None) -> bool:
    """A transformers top-k router (its class's name says so) with a [experts, hidden] weight in bfloat16 or
    float16 on a CPU."""
    weight = getattr(router, "weight", None)
    return (
        router is not None
        and type(router).__name__.endswith("TopKRouter")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
    )
