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

The decoder runner (decoder_runner.py) serves LFM2's and LFM3's layers
itself: a convolution layer is its in_proj, `RowConvolution` and its
out_proj where an attention layer has q, k and v, attention and o. Outside
the runner (the benchmarks' transformers-modules baseline) the layer is
transformers' module, its mixer mixing over the rows (model/hybrid.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from backend.layers.decode_ops import EAGER, DecodeOps
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
    return mixer.out_proj(RowConvolution(mixer, conv).over_pack(mixer.in_proj(hidden), layout))


@dataclass(frozen=True)
class RowConvolution:
    """What a short convolution layer does between its in_proj and its out_proj, over its rows' last inputs
    (`states`, [rows, hidden, kernel], advanced in place): B * x convolved, gated by C."""

    mixer: nn.Module  # its `conv` the convolution's weights
    states: torch.Tensor

    def over_pack(self, projected: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """The pack's tokens ([tokens, 3 * hidden]: B, C and x), decode queries and prompt chunks."""
        b, c, x = projected.chunk(3, dim=-1)
        return c * convolve(self.mixer, self.states, b * x, layout)

    def decode(self, projected: torch.Tensor, rows: torch.Tensor, ops: DecodeOps = EAGER) -> torch.Tensor:
        """One token of each of these rows ([queries, 3 * hidden]), no two alike: `over_pack`'s decode
        queries without a layout, by `ops` (EAGER's the same operations; the CPU's loop one pass)."""
        return ops.short_conv(self.states, projected, rows, self.weight, self.bias)

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        """Each channel's filter, [hidden, kernel] (the module's is [hidden, 1, kernel]), looked up once: a
        decode step reads it in every convolution layer."""
        return self.mixer.conv.weight.detach().squeeze(1).contiguous()

    @functools.cached_property
    def bias(self) -> torch.Tensor | None:
        """Each channel's bias ([hidden]), or None (LFM2's have none)."""
        return self.mixer.conv.bias
