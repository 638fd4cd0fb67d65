"""The steps of a Mamba or Falcon-Mamba model over its rows' recurrent states (layers/row_states.py).

A Mamba layer has no attention: its mixer convolves each token with the
row's last few inputs and runs a selective scan whose state carries the
row's whole past. So a step of this runner is the same pack as a
transformer's (model/step_inputs.py: a token for each decoding row, then
each prompt chunk), with the rows' states in place of a KV cache:

- the decoding rows' states are gathered, advanced one token together (transformers'
  own `causal_conv1d_update` and `mamba_selective_state_update`) and written back;
- a prompt chunk starts from its row's state, or from zeros where it starts its prompt,
  and scans its tokens one after another (transformers' recurrent form of
  `mamba_selective_scan`, which has no initial state: that is why a long
  prompt's later chunks cannot go through transformers' forward).

The projections run once over the whole pack. Each operation is the one
transformers' classes run, in the same order and dtype, so exact mode's
greedy output is `generate`'s token for token (tests/backend/test_mamba.py).
Falcon-Mamba is Mamba with an RMSNorm, without weights, of the scan's
time step, B and C.

A row's state cannot go back to an earlier position, so the engine reuses
no prefixes and verifies no drafts for these models (engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.mamba.modeling_mamba import (
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_selective_state_update,
)

from backend.layers.row_states import RowStates, StateShape
from backend.layers.step_layout import PromptChunk, StepLayout
from backend.model.step_inputs import DecodingRow, PrefillingRow, StepInputs, pack
from backend.model.step_plan import DESCRIBED_CHUNK, StepPath, StepPlan, linear_paths

LAYERS = "the rows' recurrent states, a Python loop over the layers (model/mamba.py)"
NO_ATTENTION = "none (each row's state: its last inputs and its scan's state)"


class MambaRunner:
    """Runs the steps of one Mamba-family model over its rows' states; the engine's side is ModelRunner's."""

    decoder = None  # no compact decoder runner, no graphs
    reads_own_positions = False
    decodes_in_graphs = False
    graphs_to_capture = False

    def __init__(self, model: PreTrainedModel, rows: int, embedding_row: bool = False):
        """`embedding_row`: a spare row (index `rows`) that embedding inputs are prefilled in."""
        self.model = model
        self.device = model.device
        self.cache_dtype = model.dtype  # the convolutions' inputs (the scan's state is float32)
        self.states = RowStates(
            StateShape.of(model.config), rows + int(embedding_row), model.dtype, self.device
        )
        self.embedding_row = rows if embedding_row else None
        self.embedded_states: torch.Tensor | None = None
        self.normed_scan = model.config.model_type == "falcon_mamba"
        self.plan = plan_states(rows, model)

    @property
    def most_queries(self) -> int:
        return len(self.plan.decode)

    def prepare(
        self,
        decoding: Sequence[DecodingRow],
        prefilling: Sequence[PrefillingRow],
        embedding: PrefillingRow | None = None,
    ) -> StepInputs:
        return pack(decoding, prefilling, self.device, self.model.dtype, False, embedding)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The logits at the kept places, [kept, vocab]; `embedded_states` as ModelRunner.run gives them."""
        backbone = self.model.backbone
        hidden = backbone.embeddings(inputs.token_ids)
        for layer, block in enumerate(backbone.layers):
            residual = hidden
            normed = block.norm(hidden.to(dtype=block.norm.weight.dtype))
            if block.residual_in_fp32:
                residual = residual.to(torch.float32)
            hidden = residual + self.mix(block.mixer, layer, normed, inputs.layout)
        embedded = inputs.embedded
        self.embedded_states = None
        if embedded is not None:
            self.embedded_states = backbone.norm_f(hidden[embedded.start : embedded.stop])
        kept = backbone.norm_f(hidden[inputs.keep])
        return self.model.lm_head(kept.to(self.model.dtype)).float()  # the head's dtype, quantized or not

    def mix(self, mixer: nn.Module, layer: int, hidden: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """One layer's mixer over the pack ([tokens, hidden]), its rows' states advanced."""
        inputs, gate = mixer.in_proj(hidden).chunk(2, dim=-1)  # [tokens, channels] each
        convolved = self.convolve(mixer, layer, inputs, layout)
        time_step, B, C = torch.split(
            mixer.x_proj(convolved),
            [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size],
            dim=-1,
        )
        if self.normed_scan:
            time_step, B, C = mixer.dt_layernorm(time_step), mixer.b_layernorm(B), mixer.c_layernorm(C)
        time_step = mixer.dt_proj.weight @ time_step.T  # [channels, tokens], as transformers multiplies it
        scanned = self.scan(mixer, layer, convolved, time_step, B, C, gate, layout)
        return mixer.out_proj(scanned)

    def convolve(
        self, mixer: nn.Module, layer: int, inputs: torch.Tensor, layout: StepLayout
    ) -> torch.Tensor:
        """The causal convolution of every token over its row's last inputs, which the rows then keep."""
        conv, weight, bias = self.states.conv[layer], mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
        kernel = conv.shape[-1]
        convolved = torch.empty_like(inputs)
        decoded, rows = layout.decode_queries, layout.decode_index
        if decoded:
            state = conv.index_select(0, rows)  # advanced in place, then written back
            out = causal_conv1d_update(inputs[:decoded, :, None], state, weight, bias, mixer.activation)
            conv.index_copy_(0, rows, state)
            convolved[:decoded] = out[:, :, 0]
        for chunk in layout.prompts:
            places = chunk_places(chunk)
            segment = inputs[places].T[None]  # [1, channels, length]
            if chunk.past:
                full = torch.cat([conv[chunk.row, None], segment], dim=-1)
            else:  # a prompt's start: zeros before it, as transformers pads a short prompt's state
                full = F.pad(segment, (max(kernel - chunk.length, 0), 0))
            conv[chunk.row] = full[0, :, -kernel:]
            out = causal_conv1d_fn(full, weight, bias, mixer.activation)
            convolved[places] = out[0, :, -chunk.length :].T
        return convolved

    def scan(
        self,
        mixer: nn.Module,
        layer: int,
        inputs: torch.Tensor,  # [tokens, channels]
        time_step: torch.Tensor,  # [channels, tokens]
        B: torch.Tensor,  # [tokens, state_size]
        C: torch.Tensor,
        gate: torch.Tensor,  # [tokens, channels]
        layout: StepLayout,
    ) -> torch.Tensor:
        """The selective scan of every token from its row's state, which the rows then keep."""
        ssm = self.states.ssm[layer]
        A = -torch.exp(mixer.A_log.float())
        time_bias = mixer.dt_proj.bias.float()
        scanned = torch.empty_like(inputs)
        decoded, rows = layout.decode_queries, layout.decode_index
        if decoded:
            state = ssm.index_select(0, rows)
            scanned[:decoded] = mamba_selective_state_update(
                state,
                inputs[:decoded],
                time_step[:, :decoded].T,
                A,
                B[:decoded],
                C[:decoded],
                mixer.D,
                z=gate[:decoded],
                dt_bias=time_bias,
                dt_softplus=True,
            )
            ssm.index_copy_(0, rows, state)
        for chunk in layout.prompts:
            places = chunk_places(chunk)
            initial = ssm[chunk.row, None] if chunk.past else None
            out, ssm[chunk.row] = scan_chunk(
                inputs[places].T[None],
                time_step[None, :, places],
                A,
                B[None, places],
                C[None, places],
                mixer.D.float(),
                gate[places].T[None],
                time_bias,
                initial,
            )
            scanned[places] = out[0].T
        return scanned


def scan_chunk(
    inputs: torch.Tensor,  # [1, channels, length]
    time_step: torch.Tensor,  # [1, channels, length]
    A: torch.Tensor,  # [channels, state_size]
    B: torch.Tensor,  # [1, length, state_size]
    C: torch.Tensor,  # [1, length, state_size]
    D: torch.Tensor,  # [channels]
    gate: torch.Tensor,  # [1, channels, length]
    time_bias: torch.Tensor,
    initial: torch.Tensor | None,  # [1, channels, state_size]; None: zeros
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form of transformers' `mamba_selective_scan`, step for step, from a row's state:
    the chunk's outputs [1, channels, length] and the state after it [channels, state_size]."""
    dtype = inputs.dtype
    time_step = F.softplus(time_step + time_bias.to(time_step.dtype)[..., None])
    discrete_A = torch.exp(A[None, :, None, :] * time_step[:, :, :, None])
    deltaB_u = time_step[:, :, :, None] * B[:, None, :, :].float() * inputs[:, :, :, None].float()
    state = initial if initial is not None else torch.zeros(1, *A.shape, dtype=dtype, device=inputs.device)
    outputs = []
    for index in range(inputs.shape[-1]):
        state = discrete_A[:, :, index] * state + deltaB_u[:, :, index]
        outputs.append(torch.matmul(state.to(dtype), C[:, index, :].unsqueeze(-1))[:, :, 0])
    scanned = torch.stack(outputs, dim=-1) + inputs * D[None, :, None]
    return scanned * F.silu(gate), state[0]


def chunk_places(chunk: PromptChunk) -> slice:
    return slice(chunk.start, chunk.start + chunk.length)


def plan_states(rows: int, model: PreTrainedModel) -> StepPlan:
    """The runner's plan: one path whatever the shape, its projections as they multiply that many rows."""
    head = model.get_output_embeddings()
    projections = [module for name, module in model.backbone.named_modules() if name.endswith("_proj")]

    def path(count: int) -> StepPath:
        return StepPath(LAYERS, NO_ATTENTION, linear_paths(projections, count), linear_paths([head], count))

    return StepPlan(tuple(path(n) for n in range(1, rows + 1)), None, path(DESCRIBED_CHUNK))
