"""LFM2's (and LFM3's) short convolution layers over the rows' recurrent states (layers/row_states.py).

Most of LFM2's layers (10 of LFM2-1.2B's 16) are no attention but a gated
convolution: the layer projects each token to B, C and x, convolves B * x
with the row's last two inputs (a kernel of 3, one filter a channel), and
gates the result by C. A row's history is then its last inputs alone, kept
as a Mamba's convolution inputs are (`conv`), with no scan state beside
them; the engine reuses such a row's whole history only and verifies no
drafts, as for the other hybrids. The convolution is Mamba's
(`mamba.convolve`), without an activation, so that exact mode gives
`generate`'s tokens (tests/backend/test_exactness.py).
"""

from __future__ import annotations

import torch
from torch import nn

from backend.layers.step_layout import StepLayout
from backend.model.mamba import convolve

# transformers' classes of these layers, by name (LFM2's, LFM2-MoE's and LFM3's: a kernel of 7 where LFM2's
# is 3).
SHORT_CONV_MIXERS = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def is_short_conv(mixer: nn.Module) -> bool:
    return any(kind.__name__ in SHORT_CONV_MIXERS for kind in type(mixer).__mro__)


def mix_short_conv(
    mixer: nn.Module, conv: torch.Tensor, hidden: torch.Tensor, layout: StepLayout
) -> torch.Tensor:
    """A short convolution layer over the pack ([tokens, hidden]), its rows' last inputs `conv` advanced."""
    b, c, x = mixer.in_proj(hidden).chunk(3, dim=-1)  # [tokens, hidden] each
    return mixer.out_proj(c * convolve(mixer, conv, b * x, layout))
