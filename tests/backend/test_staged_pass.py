"""A separate model's pass run a few layers at a time (model/staged_pass.py): the same result as the pass
whole, exactly the layers allowed run at each advance, and nothing of the pass runs in between."""

import pytest
import torch
from transformers import BertConfig, BertModel

from backend.model.embeddings import embed
from backend.model.staged_pass import StagedPass, layers_of

PROMPTS = [(2, 5, 7, 9, 4), (3, 8, 6)]


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=16,
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return BertModel(config).eval()


def test_layers_are_the_module_list_of_num_hidden_layers(encoder):
    assert layers_of(encoder) == list(encoder.encoder.layer)
    assert layers_of(torch.nn.Linear(2, 2)) == []  # (no config: the pass runs whole)


def test_a_pass_goes_the_layers_each_advance_allows_and_gives_what_it_gives_whole(encoder):
    ran: list[int] = []
    handles = [
        layer.register_forward_hook(lambda module, args, output, i=i: ran.append(i))
        for i, layer in enumerate(encoder.encoder.layer)
    ]
    try:
        staged = StagedPass(lambda: embed(encoder, PROMPTS, "mean"), layers_of(encoder))
        assert ran == [] and not staged.done  # nothing before the first advance
        staged.advance(1)
        assert ran == [0] and not staged.done
        # Between advances the pass waits: the engine's thread runs the same model whole meanwhile.
        with torch.no_grad():
            whole = embed(encoder, PROMPTS, "mean")
        assert ran == [0, 0, 1, 2, 3]
        ran.clear()
        staged.advance(2)
        assert ran == [1, 2] and not staged.done
        staged.advance(2)  # one layer left: it runs, and the pooling after it
        assert ran == [1, 2, 3] and staged.done and staged.error is None
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(staged.result, whole, atol=1e-6, rtol=1e-5)
    assert not encoder.encoder.layer[0]._forward_pre_hooks  # the pass's hooks are gone with it


def test_an_error_in_the_pass_is_its_result_and_an_abandoned_pass_ends_its_thread(encoder):
    def fails() -> torch.Tensor:
        embed(encoder, PROMPTS, "mean")
        raise RuntimeError("out of memory")

    failing = StagedPass(fails, layers_of(encoder))
    failing.finish()
    assert failing.done and isinstance(failing.error, RuntimeError) and failing.result is None

    abandoned = StagedPass(lambda: embed(encoder, PROMPTS, "mean"), layers_of(encoder))
    abandoned.advance(2)
    abandoned.abandon()
    assert abandoned.done and abandoned.result is None and abandoned.error is None
    abandoned._thread.join(timeout=5)
    assert not abandoned._thread.is_alive()
    assert not encoder.encoder.layer[0]._forward_pre_hooks
