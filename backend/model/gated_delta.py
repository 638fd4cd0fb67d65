"""Qwen3-Next's, Qwen3.5's and OLMo's hybrid's Gated DeltaNet layers over the rows' recurrent states
(layers/row_states.py).

Three of every four layers of these hybrids are "linear attention": a Gated
DeltaNet keeps, for each value head, one [key_dim, value_dim] matrix that
maps keys to values. Each token decays it (its gate), corrects what it
predicts for the token's key towards the token's value (the delta rule, at
the token's rate beta), and reads it with the token's query. Before that, a
short causal convolution mixes each token's queries, keys and values with
the row's last few, as Mamba's does. Both are a row's whole history in a
fixed size, like a Mamba's state: the engine keeps them as it keeps those
(row_states.RowStates: `conv` the convolution's last inputs, `ssm` the
matrices), reuses a row's whole history only and verifies no drafts.

A step runs the layer over the pack as model/hybrid.py runs a Mamba mixer:

- the decoding rows' states advance one token together: transformers'
  recurrent form of the rule (`torch_recurrent_gated_delta_rule`) value for
  value in exact mode (decode_ops.EagerOps.gated_delta_update), else the
  CPU's loop, in two passes over each head's state where PyTorch's
  operations made some eight (decode_ops.FusedOps);
- a prompt chunk starts from its row's state, or from zeros where it starts
  its prompt, through transformers' chunked form (`torch_chunk_gated_delta_rule`,
  which takes a state to start from and gives the last one).

Each operation is the one transformers' class runs, in the same order and dtype, so that exact mode
gives `generate`'s tokens (tests/backend/test_exactness.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm, torch_chunk_gated_delta_rule

from backend.layers.decode_ops import EAGER, DecodeOps
from backend.layers.step_layout import StepLayout
from backend.model.mamba import chunk_places, convolve, decoding_states

# transformers' classes of these layers, by name (Qwen3-Next's, Qwen3.5's, Qwen3.5-MoE's and OLMo's hybrid's).
GATED_DELTA_MIXERS = (
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "OlmoHybridGatedDeltaNet",
)


def mix_gated_delta(
    mixer: nn.Module,
    conv: torch.Tensor,
    state: torch.Tensor,
    hidden: torch.Tensor,
    layout: StepLayout,
    ops: DecodeOps = EAGER,
) -> torch.Tensor:
    """A Gated DeltaNet over the pack ([tokens, hidden]), its rows' `conv` inputs and `state` matrices
    ([rows, value_heads, key_dim, value_dim], float32) advanced; `ops` advances the decoding rows'
    (mamba.state_ops: the CPU's loop, but in exact mode)."""
    mixed, gate, b, a = project(mixer, hidden)
    convolved = convolve(mixer, conv, mixed, layout)
    query, key, value = convolved.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.unflatten(-1, (-1, mixer.head_k_dim))  # [tokens, key_heads, key_dim]
    key = key.unflatten(-1, (-1, mixer.head_k_dim))
    value = value.unflatten(-1, (-1, mixer.head_v_dim))  # [tokens, value_heads, value_dim]
    beta = b.sigmoid()
    if getattr(mixer, "allow_neg_eigval", False):  # OLMo's: a rate of 0..2, an update that may overshoot
        beta = beta * 2.0
    decay = -mixer.A_log.float().exp() * nn.functional.softplus(a.float() + mixer.dt_bias)
    attended = torch.empty_like(value)
    decoded = layout.decode_queries
    if decoded:
        token = [part[:decoded] for part in (query, key, value, decay, beta)]
        with decoding_states(state, layout) as states:
            attended[:decoded] = ops.gated_delta_update(states, *for_update(*token)).to(value.dtype)
    for chunk in layout.prompts:
        places = chunk_places(chunk)
        out, state[chunk.row] = torch_chunk_gated_delta_rule(
            *(part[None, places] for part in (query, key, value, decay, beta)),
            initial_state=state[chunk.row, None] if chunk.past else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        attended[places] = out[0]
    olmo = hasattr(mixer, "o_proj")  # OLMo's names for the norm and the output projection
    norm, out_proj = (mixer.o_norm, mixer.o_proj) if olmo else (mixer.norm, mixer.out_proj)
    normed = norm(attended.reshape(-1, mixer.head_v_dim), gate.reshape(-1, mixer.head_v_dim))
    return out_proj(normed.reshape(hidden.shape[0], -1))


def for_update(
    query: torch.Tensor,  # [rows, key_heads, key_dim]
    key: torch.Tensor,
    value: torch.Tensor,  # [rows, value_heads, value_dim]
    decay: torch.Tensor,  # [rows, value_heads], its log
    beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """A token's query, key, value, decay and beta as `DecodeOps.gated_delta_update` takes them: what
    transformers' `torch_recurrent_gated_delta_rule` does to them before its loop, the same operations
    (each key head's query and key repeated for its value heads, float32, normed, the query scaled),
    and the decay's factor."""
    group = value.shape[1] // key.shape[1]
    if group > 1:
        query, key = (part.repeat_interleave(group, dim=1) for part in (query, key))
    query, key, value, decay, beta = (part.float() for part in (query, key, value, decay, beta))
    query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    return query / (query.shape[-1] ** 0.5), key, value, decay.exp(), beta


def project(mixer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layer's projections of the pack: its queries, keys and values as the convolution takes them
    ([tokens, channels]), its output gate ([tokens, value_heads, value_dim]) and its b and a ([tokens,
    value_heads]: the update's rate and the decay's step). Qwen3-Next projects them in two fused
    matrices, their heads interleaved by key head; Qwen3.5 in four; OLMo's hybrid in six."""
    if hasattr(mixer, "g_proj"):
        mixed = torch.cat([mixer.q_proj(hidden), mixer.k_proj(hidden), mixer.v_proj(hidden)], dim=-1)
        gate = mixer.g_proj(hidden).unflatten(-1, (-1, mixer.head_v_dim))
        return mixed, gate, mixer.b_proj(hidden), mixer.a_proj(hidden)
    if hasattr(mixer, "in_proj_qkvz"):
        query, key, value, gate, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(hidden)[None], mixer.in_proj_ba(hidden)[None]
        )
        mixed = torch.cat([part[0].flatten(1) for part in (query, key, value)], dim=-1)
        return mixed, gate[0], b[0], a[0]
    gate = mixer.in_proj_z(hidden).unflatten(-1, (-1, mixer.head_v_dim))
    return mixer.in_proj_qkv(hidden), gate, mixer.in_proj_b(hidden), mixer.in_proj_a(hidden)
