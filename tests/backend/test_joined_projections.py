"""Float q, k and v (and gate and up) as one product of their joined weights outside exact mode
(decoder_runner.join_float_linears): fewer, larger products a step (a GPU's kernel launches), on the
same memory, and the same answers."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from backend.model import decoder_runner
from backend.model.decoder_runner import DecoderRunner
from tests.backend.lora_files import write_lora_adapter
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, logprobs_of, text_of, tiny_model


def test_float_projections_are_one_product_of_weights_joined_where_they_were():
    """Qwen2's q, k and v have biases: joined too. The layers' own weights become views of the joined
    ones (the model's memory is not doubled), and a second runner on the same model joins them again
    without a copy (the benchmarks build several engines on one model)."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    weights = [p.weight.clone() for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    biases = [p.bias.clone() for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    runner = DecoderRunner(model, rows=4)
    (qkv,) = runner.qkv[0].groups
    assert type(qkv) is nn.Linear and qkv.out_features == sum(w.shape[0] for w in weights)
    assert torch.equal(qkv.weight, torch.cat(weights)) and torch.equal(qkv.bias, torch.cat(biases))
    assert attention.q_proj.weight.data_ptr() == qkv.weight.data_ptr()
    assert attention.v_proj.weight.data_ptr() == qkv.weight[-weights[2].shape[0] :].data_ptr()
    assert torch.equal(attention.k_proj.weight, weights[1]) and torch.equal(attention.v_proj.bias, biases[2])
    (gate_up,) = runner.gate_up[0].groups
    assert gate_up.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() and gate_up.bias is None
    again = DecoderRunner(model, rows=4)
    assert again.qkv[0].groups[0].weight.data_ptr() == qkv.weight.data_ptr()
    assert again.gate_up[0].groups[0].weight.data_ptr() == gate_up.weight.data_ptr()


def test_exact_mode_multiplies_each_projection_by_its_own_layer():
    model = tiny_model("llama")  # float32, not quantized: the exact mode
    runner = DecoderRunner(model, rows=4)
    attention = model.model.layers[0].self_attn
    assert runner.qkv[0].groups == [attention.q_proj, attention.k_proj, attention.v_proj]
    assert len(runner.gate_up[0].groups) == 2


class LinearCalls(TorchDispatchMode):
    """Counts the matrix products of linear layers dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket.__name__ in ("linear", "addmm", "mm")
        return func(*args, **(kwargs or {}))


def test_a_decode_step_makes_four_products_a_layer_where_it_made_seven():
    """q, k, v, o, gate, up, down: seven products a layer, one kernel launch each on a GPU; joined,
    four (and the head's one)."""
    model = tiny_model("llama").to(torch.bfloat16)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=64, speculative_tokens=0)
    for i in range(4):
        engine.submit(Submit(f"r{i}", (5, 6, 7 + i), SamplingParams(temperature=0, max_tokens=8)))
    engine.step()  # the prompts
    counter = LinearCalls()
    with counter:
        engine.step()
    assert counter.calls == 4 * len(model.model.layers) + 1


def answers(model: nn.Module, adapter_dir, prompts) -> dict[str, tuple[str, list]]:
    from backend.model.lora import load_adapters

    adapters = load_adapters(model, [("a", str(adapter_dir))])
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, adapters=adapters)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    arrivals = [
        (i, Submit(f"r{i}", prompt, params, adapter="a" if i % 2 else ""))  # rows of the adapter and not
        for i, prompt in enumerate(prompts)
    ]
    pieces = drive(engine, arrivals)
    return {name: (text_of(p), [entry.logprob for entry in logprobs_of(p)]) for name, p in pieces.items()}


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_joined_projections_answer_as_the_layers_one_by_one_with_and_without_an_adapter(
    tmp_path, architecture, monkeypatch
):
    """bfloat16 rows, greedy, with logprobs, an adapter's rows beside the model's (its changes added
    to the joined product's output): the same tokens, and logprobs within a rounding, as the same
    engine multiplying each layer apart."""
    base = tiny_model(architecture)
    write_lora_adapter(tmp_path / "a", base, "all-linear", seed=3)
    rng = random.Random(architecture)
    prompts = [tuple(rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 30))) for _ in range(6)]
    joined = answers(tiny_model(architecture).to(torch.bfloat16), tmp_path / "a", prompts)
    monkeypatch.setattr(decoder_runner, "join_float_linears", lambda parts: None)
    apart = answers(tiny_model(architecture).to(torch.bfloat16), tmp_path / "a", prompts)
    assert joined.keys() == apart.keys() == {f"r{i}" for i in range(6)}
    for name, (text, logprobs) in joined.items():
        assert text == apart[name][0], name
        assert logprobs == pytest.approx(apart[name][1], abs=0.05), name
