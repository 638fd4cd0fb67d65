"""Embedding requests in the engine: pooled hidden states, batched beside decoding rows."""

import pytest
import torch

from backend.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import MarkerTokenizer, tiny_model

PROMPTS = [tuple(range(5, 5 + n)) for n in (3, 17, 9, 30)]


def alone(model, prompt: tuple[int, ...], pooling: str) -> torch.Tensor:
    """The prompt's embedding computed by itself, with no padding, straight from transformers."""
    with torch.no_grad():
        hidden = model.base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=-1)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_each_prompt_of_a_padded_batch_is_embedded_as_it_is_alone(architecture, pooling):
    model = tiny_model(architecture)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=1000)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Submit(f"e{i}", prompt, SamplingParams(embedding=pooling)))
    pieces = {piece.request_id: piece for piece in engine.step()}  # all four in one batch
    assert not engine.has_work
    for i, prompt in enumerate(PROMPTS):
        piece = pieces[f"e{i}"]
        assert piece.finish_reason == "stop" and piece.prompt_tokens == len(prompt) and piece.text == ""
        vector = torch.tensor(piece.embedding)
        assert vector.shape == (model.config.get_text_config().hidden_size,)
        torch.testing.assert_close(vector, alone(model, prompt, pooling), atol=1e-5, rtol=1e-4)


def test_embeddings_are_served_beside_decoding_within_the_prefill_budget():
    model = tiny_model("llama")
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, max_prefill_tokens=20)
    engine.submit(Submit("decode", (3, 4, 5), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    engine.step()  # prefilled: decoding from now on
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Submit(f"e{i}", prompt, SamplingParams(embedding="mean")))
    embedded_per_step = []
    for _ in range(4):
        pieces = engine.step()
        assert any(p.request_id == "decode" and p.text for p in pieces)  # the row got its token
        embedded_per_step.append([p.prompt_tokens for p in pieces if p.embedding is not None])
    # At most 20 prompt tokens a step, and at least one prompt: 3 + 17, then 9 (30 more would pass
    # 20), then 30 alone, over the budget.
    assert embedded_per_step == [[3, 17], [9], [30], []]


def test_a_cancelled_embedding_request_ends_cancelled():
    engine = Engine(tiny_model("llama"), MarkerTokenizer(), rows=2, max_seq_len=64)
    engine.submit(Submit("e", (1, 2, 3), SamplingParams(embedding="mean")))
    engine.cancel("e")
    assert [(p.request_id, p.finish_reason) for p in engine.step()] == [("e", "cancelled")]
