"""A hybrid model's recurrent layers over the step's rows: transformers' modules run as they are, their
attention layers over the row cache (layers/attention.py), their recurrent mixers over the rows' states
(layers/row_states.py).

Bamba, Granite 4, Falcon-H1 and Nemotron-H mix with Mamba-2 layers (mamba.mix_mamba2), Jamba with
Mamba's (mamba.mix_mamba), Qwen3-Next, Qwen3.5 and OLMo's hybrid with Gated DeltaNets (gated_delta.py),
LFM2 with short convolutions (short_conv.py).
Each mixer object keeps its class's weights and gets a class above its own whose forward, inside an
engine's step, mixes the pack over its layer's states; outside one (`generate`, say) it is
transformers' own. (LFM2's and LFM3's steps run on the decoder runner, which calls no mixer's forward
but convolves over the same states: short_conv.RowConvolution.)
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from backend.layers.attention import _current_layout
from backend.layers.decode_ops import DecodeOps
from backend.layers.row_states import RowStates
from backend.model.gated_delta import GATED_DELTA_MIXERS, mix_gated_delta
from backend.model.mamba import mix_mamba, mix_mamba2, state_ops
from backend.model.mix_in import mix_in
from backend.model.short_conv import SHORT_CONV_MIXERS, is_short_conv, mix_short_conv

# The mixers of hybrid models (transformers' classes, by name): Mamba2Mixer's forward, Jamba's
# FalconMambaMixer's (its norms with weights), the Gated DeltaNets and LFM2's short convolutions.
HYBRID_MIXERS = (
    "BambaMixer",
    "GraniteMoeHybridMambaLayer",
    "FalconH1Mixer",
    "NemotronHMamba2Mixer",
    "JambaMambaMixer",
    *GATED_DELTA_MIXERS,
    *SHORT_CONV_MIXERS,
)


def mix_over_rows(model: PreTrainedModel, states: RowStates) -> None:
    """Make each recurrent mixer of a hybrid model mix over the step's rows and their `states` (a layer of
    them a mixer, in order) inside `attending_over`. The model's forward runs as it is around them: its
    attention layers attend over the row cache, its mixers never read the cache passed."""
    mixers = [module for module in model.modules() if is_hybrid_mixer(module)]
    if len(mixers) != states.shape.layers:
        raise ValueError(f"{len(mixers)} recurrent mixers in the model, states for {states.shape.layers}")
    ops = state_ops(model)
    for index, mixer in enumerate(mixers):
        mix_in(mixer, MixesOverRows)
        mixer.row_states = (states.conv[index], states.ssm[index])
        mixer.row_ops = ops


def is_hybrid_mixer(module: nn.Module) -> bool:
    """Whether a module is a hybrid's recurrent mixer, by its class or the class it had before an engine's
    was mixed in above it (a second engine over the same model: the benchmarks')."""
    return any(kind.__name__ in HYBRID_MIXERS for kind in type(module).__mro__)


class MixesOverRows:
    """A hybrid's mixer over the step's rows, mixed in above the mixer's own class."""

    row_states: tuple[torch.Tensor, torch.Tensor]  # this layer's (conv, ssm) of every row
    row_ops: DecodeOps  # what advances a decoding row's Mamba-2 or Gated DeltaNet state (mamba.state_ops)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layout = _current_layout.get(None)
        if layout is None:  # not in an engine's step: transformers' mixer over its own cache
            return super().forward(hidden_states, *args, **kwargs)
        conv, ssm = self.row_states
        if is_short_conv(self):  # LFM2's: a convolution alone, no scan
            return mix_short_conv(self, conv, hidden_states[0], layout)[None]
        if hasattr(self, "head_k_dim"):  # a Gated DeltaNet: a matrix a value head, keys to values
            return mix_gated_delta(self, conv, ssm, hidden_states[0], layout, self.row_ops)[None]
        if hasattr(self, "x_proj"):  # Jamba's Mamba mixer, with norms of its scan's time step, B and C
            return mix_mamba(self, conv, ssm, hidden_states[0], layout, normed_scan=True)[None]
        return mix_mamba2(self, conv, ssm, hidden_states[0], layout, self.row_ops)[None]
