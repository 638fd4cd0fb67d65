"""The steps of a Mamba, Falcon-Mamba or Mamba-2 model over its rows' recurrent states (layers/row_states.py).

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
greedy output is `generate`'s token for token (tests/backend/test_exactness.py, test_mamba.py).
Falcon-Mamba is Mamba with an RMSNorm, without weights, of the scan's
time step, B and C. Mamba-2 (`mix_mamba2`) scans heads that share a decay,
its B and C convolved with its inputs, its output normed with the gate; its
prompt chunks go through transformers' chunked scan, which takes a state.

A hybrid (Bamba, Granite 4, Falcon-H1, Jamba, Nemotron-H) runs
transformers' modules over the row cache instead, its Mamba-2 mixers given
`mix_mamba2` as their forward inside a step, Jamba's Mamba mixers
`mix_mamba` (model/hybrid.py).

A row's state cannot go back to an earlier position, so the engine reuses a
row's whole history only (a chat's next turn, `PrefixIndex.whole_only`) and
verifies no drafts for these models (engine.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.mamba.modeling_mamba import (
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_selective_state_update,
)
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

from backend.layers.decode_ops import EAGER, DecodeOps, decode_ops
from backend.layers.row_states import RowStates, StateShape
from backend.layers.step_layout import PromptChunk, StepLayout
from backend.model.step_inputs import DecodingRow, PrefillingRow, StepInputs, pack
from backend.model.step_plan import DESCRIBED_CHUNK, StepPath, StepPlan, linear_paths
from backend.quant.quantized_linear import WeightOnlyLinear

LAYERS = "the rows' recurrent states, a Python loop over the layers (model/mamba.py)"
NO_ATTENTION = "none (each row's state: its last inputs and its scan's state)"


class MambaRunner:
    """Runs the steps of one Mamba-family model over its rows' states; the engine's side is ModelRunner's."""

    decoder = None  # no compact decoder runner, no graphs
    reads_own_positions = False
    takes_prompts_as_queries = False
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
        self.model_type = model.config.model_type
        self.ops = state_ops(model)
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
        conv, ssm = self.states.conv[layer], self.states.ssm[layer]
        if self.model_type == "mamba2":
            return mix_mamba2(mixer, conv, ssm, hidden, layout, self.ops)
        return mix_mamba(mixer, conv, ssm, hidden, layout, normed_scan=self.model_type == "falcon_mamba")


def mix_mamba(
    mixer: nn.Module,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    hidden: torch.Tensor,
    layout: StepLayout,
    normed_scan: bool,
) -> torch.Tensor:
    """A Mamba (or Falcon-Mamba: `normed_scan`) mixer over the pack, as transformers' MambaMixer."""
    inputs, gate = mixer.in_proj(hidden).chunk(2, dim=-1)  # [tokens, channels] each
    convolved = convolve(mixer, conv, inputs, layout)
    sizes = [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size]
    time_step, B, C = torch.split(mixer.x_proj(convolved), sizes, dim=-1)
    if normed_scan:
        time_step, B, C = mixer.dt_layernorm(time_step), mixer.b_layernorm(B), mixer.c_layernorm(C)
    time_step = project_time_step(mixer.dt_proj, time_step)
    A = -torch.exp(mixer.A_log.float())
    time_bias = mixer.dt_proj.bias.float()
    scanned = torch.empty_like(convolved)
    decoded = layout.decode_queries
    if decoded:
        with decoding_states(ssm, layout) as state:
            scanned[:decoded] = mamba_selective_state_update(
                state,
                convolved[:decoded],
                time_step[:, :decoded].T,
                A,
                B[:decoded],
                C[:decoded],
                mixer.D,
                z=gate[:decoded],
                dt_bias=time_bias,
                dt_softplus=True,
            )
    for chunk in layout.prompts:
        places = chunk_places(chunk)
        initial = ssm[chunk.row, None] if chunk.past else None
        out, ssm[chunk.row] = scan_chunk(
            convolved[places].T[None],
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
    return mixer.out_proj(scanned)


def project_time_step(dt_proj: nn.Module, time_step: torch.Tensor) -> torch.Tensor:
    """dt_proj's weight times the time step ([tokens, rank]), without its bias (the scan adds it), as
    [channels, tokens], multiplied as transformers multiplies it; a quantized dt_proj (a rank of whole
    groups: 160 in mamba-2.8b) by its layer, less its bias, as transformers does for quantized models."""
    if type(dt_proj) is nn.Linear:
        return dt_proj.weight @ time_step.T
    return (dt_proj(time_step) - dt_proj.bias).T


def mix_mamba2(
    mixer: nn.Module,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    hidden: torch.Tensor,
    layout: StepLayout,
    ops: DecodeOps = EAGER,
) -> torch.Tensor:
    """A Mamba-2 mixer over the pack, as transformers' Mamba2Mixer: its heads share a decay a head, its
    B and C come out of the convolution, its output is normed with the gate. transformers' chunked scan
    takes a row's state to start from. Falcon-H1's mixer scales its input and projections
    (`ssm_in_multiplier`, `mup_vector`) and may gate its output without the norm (`mamba_rms_norm`)."""
    inner, heads, head_dim = mixer.intermediate_size, mixer.num_heads, mixer.head_dim
    groups, state_size = mixer.n_groups, mixer.ssm_state_size
    if hasattr(mixer, "ssm_in_multiplier"):
        hidden = hidden * mixer.ssm_in_multiplier
    projected = mixer.in_proj(hidden)
    if hasattr(mixer, "mup_vector"):
        projected = projected * mixer.mup_vector.reshape(-1)  # kept as [1, 1, projections]
    gate, mixed, time_step = projected.split([inner, mixer.conv_dim, heads], dim=-1)
    convolved = convolve(mixer, conv, mixed, layout)
    inputs, B, C = convolved.split([inner, groups * state_size, groups * state_size], dim=-1)
    A = -torch.exp(mixer.A_log.float())
    scanned = torch.empty_like(inputs)
    decoded = layout.decode_queries
    if decoded:
        with decoding_states(ssm, layout) as state:
            scanned[:decoded] = advance_mamba2(
                state,
                inputs[:decoded].view(decoded, heads, head_dim),
                time_step[:decoded],
                A,
                B[:decoded].view(decoded, groups, state_size),
                C[:decoded].view(decoded, groups, state_size),
                mixer.D,
                mixer.dt_bias,
                ops,
            ).view(decoded, inner)
    for chunk in layout.prompts:
        places, length = chunk_places(chunk), chunk.length
        out, final = mamba2_chunk_scan(
            inputs[places].view(1, length, heads, head_dim),
            time_step[None, places],
            A,
            B[places].view(1, length, groups, state_size),
            C[places].view(1, length, groups, state_size),
            chunk_size=mixer.chunk_size,
            D=mixer.D,
            z=None,
            return_final_states=True,
            dt_bias=mixer.dt_bias,
            dt_softplus=True,
            initial_states=ssm[chunk.row, None] if chunk.past else None,
            dt_limit=mixer.time_step_limit,
        )
        ssm[chunk.row] = final[0]
        scanned[places] = out.reshape(length, inner)
    if getattr(mixer, "mamba_rms_norm", True):
        return mixer.out_proj(mixer.norm(scanned, gate).to(hidden.dtype))
    return mixer.out_proj((scanned * F.silu(gate)).to(hidden.dtype))


def convolve(mixer: nn.Module, conv: torch.Tensor, inputs: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """The causal convolution of every token ([tokens, channels]) over its row's last inputs, which the
    rows then keep in `conv`; then the mixer's activation, where it has one (LFM2's has none)."""
    layer = getattr(mixer, "conv1d", None) or mixer.conv  # LFM2's name for it
    weight, bias, kernel = layer.weight.squeeze(1), layer.bias, conv.shape[-1]
    activation = getattr(mixer, "activation", None)
    convolved = torch.empty_like(inputs)
    decoded = layout.decode_queries
    if decoded:
        with decoding_states(conv, layout) as state:
            out = causal_conv1d_update(inputs[:decoded, :, None], state, weight, bias, activation)
        convolved[:decoded] = out[:, :, 0]
    for chunk in layout.prompts:
        places = chunk_places(chunk)
        segment = inputs[places].T[None]  # [1, channels, length]
        if chunk.past:
            full = torch.cat([conv[chunk.row, None], segment], dim=-1)
        else:  # a prompt's start: zeros before it, as transformers pads a short prompt's state
            full = F.pad(segment, (max(kernel - chunk.length, 0), 0))
        conv[chunk.row] = full[0, :, -kernel:]
        out = causal_conv1d_fn(full, weight, bias, activation)
        convolved[places] = out[0, :, -chunk.length :].T
    return convolved


def state_ops(model: PreTrainedModel) -> DecodeOps:
    """What advances the decoding rows' Mamba-2 states: the C++ extension's loop on a CPU, but in exact
    mode (float32 weights, none quantized: transformers' arithmetic) and where it cannot be built."""
    exact = model.dtype == torch.float32 and not any(isinstance(m, WeightOnlyLinear) for m in model.modules())
    return decode_ops(model.device, exact, compiled=False)


@contextlib.contextmanager
def decoding_states(states: torch.Tensor, layout: StepLayout) -> Iterator[torch.Tensor]:
    """The decoding rows' states, to advance in place: a view where they are rows 0..n-1 (no free row
    between them), else a gathered copy, written back after."""
    if not layout.has_free_rows:
        yield states[: layout.decode_queries]
        return
    gathered = states.index_select(0, layout.decode_index)
    yield gathered
    states.index_copy_(0, layout.decode_index, gathered)


def advance_mamba2(
    state: torch.Tensor,  # [rows, heads, head_dim, state_size] float32, advanced in place
    inputs: torch.Tensor,  # [rows, heads, head_dim]
    time_step: torch.Tensor,  # [rows, heads]
    A: torch.Tensor,  # [heads]
    B: torch.Tensor,  # [rows, groups, state_size]
    C: torch.Tensor,
    D: torch.Tensor,  # [heads]
    time_bias: torch.Tensor,  # [heads]
    ops: DecodeOps = EAGER,
) -> torch.Tensor:
    """One token of each row through the scan: transformers' `mamba2_selective_state_update`, with each
    head's decay computed once, not once for each of its head_dim x state_size numbers (the same
    number, repeated), and the state advanced in place: EAGER's operations value for value (exact
    mode), or the C++ extension's loop in one pass over the state (decode_ops.FusedOps). That
    function's temporaries of the state's size made a 32-row step of a Mamba-2 of 130M 370 ms on a
    2-core CPU."""
    per_group = inputs.shape[1] // B.shape[1]
    time_step = F.softplus(time_step + time_bias.to(time_step.dtype))  # [rows, heads]
    decay = torch.exp(time_step.float() * A.float())
    B = B.repeat_interleave(per_group, dim=1)  # [rows, heads, state_size]
    C = C.repeat_interleave(per_group, dim=1)
    return ops.ssm_update(state, inputs, time_step, decay, B, C, D)


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
