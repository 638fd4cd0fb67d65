"""Constrained decoding in the engine (backend/layers/grammar.py), on the default model: output that follows
its grammar, and rows beside it that are not changed by it."""

import json

import jsonschema
import llguidance
import pytest
import torch

from backend.messages import SamplingParams, Submit
from inference_api.structured_output import json_schema_grammar
from tests.backend.models import drive, text_of

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


def json_schema(schema: dict) -> str:
    return json_schema_grammar(schema, "json_schema")  # as the frontend makes it


def run(engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, list]:
    ids = {name: tuple(engine.tokenizer(prompt).input_ids) for name, (prompt, _) in requests.items()}
    return drive(engine, [(0, Submit(name, ids[name], params)) for name, (_, params) in requests.items()])


def test_sampled_json_follows_the_schema_every_time(default_engine):
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=120, grammar=json_schema(PERSON))
        for seed in range(20)
    ]
    pieces = run(default_engine, {f"s{i}": (PROMPT, p) for i, p in enumerate(params)})
    for name, answer in pieces.items():
        assert answer[-1].finish_reason == "stop", f"{name} did not complete: {text_of(answer)!r}"
        jsonschema.validate(json.loads(text_of(answer)), PERSON)


def test_a_completed_grammar_ends_the_answer_even_when_eos_is_ignored(default_engine):
    grammar = llguidance.LLMatcher.grammar_from_regex("(yes|no)")
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, grammar=grammar)
    [answer] = run(default_engine, {"r": ("Is water wet? Answer yes or no: ", params)}).values()
    assert text_of(answer) in ("yes", "no")
    assert answer[-1].finish_reason == "stop" and answer[-1].completion_tokens <= 2


def test_unconstrained_rows_are_token_for_token_what_they_are_alone(default_engine):
    free = {f"free{i}": SamplingParams(temperature=0.9, seed=100 + i, max_tokens=16) for i in range(16)}
    constrained = {
        f"json{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=16, grammar=json_schema(PERSON))
        for i in range(16)
    }
    prompt = "Write one sentence about the sea."
    together = run(default_engine, {name: (prompt, p) for name, p in {**free, **constrained}.items()})
    for name, params in free.items():
        alone = run(default_engine, {name: (prompt, params)})
        assert text_of(together[name]) == text_of(alone[name]), name
    for name in constrained:
        assert text_of(together[name]).startswith("{")


def test_a_grammar_the_matcher_cannot_start_from_fails_that_request_alone(default_engine):
    broken = SamplingParams(temperature=0, max_tokens=5, grammar="start: (((")
    fine = SamplingParams(temperature=0, max_tokens=5)
    pieces = run(default_engine, {"broken": ("Hello", broken), "fine": ("Hello", fine)})
    assert pieces["broken"][-1].finish_reason == "error"
    assert "grammar" in pieces["broken"][-1].error
    assert pieces["fine"][-1].finish_reason == "length" and text_of(pieces["fine"])


@pytest.mark.parametrize("choices", [("Paris", "London", "Berlin"), ("positive", "negative")])
def test_a_choice_is_one_of_the_choices(default_engine, choices):
    lark = "start: " + " | ".join(json.dumps(choice) for choice in choices)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, grammar=grammar)
    [answer] = run(default_engine, {"c": ("The capital of France is", params)}).values()
    assert text_of(answer) in choices


@pytest.mark.parametrize(
    "grammar",
    [
        llguidance.LLMatcher.grammar_from_regex("[^\\s\\S]"),  # a character that is no character
        llguidance.LLMatcher.grammar_from_lark("start: a\na: a"),  # a rule that never ends
    ],
    ids=["empty-regex", "endless-rule"],
)
def test_a_grammar_no_text_can_follow_is_refused_as_the_requests_fault(default_engine, grammar):
    # llguidance compiles both; only the first mask shows that nothing can start them. Unrefused, the mask
    # allowed EOS alone and the row stopped at once with no text, as if its grammar were met.
    dead = SamplingParams(temperature=0, max_tokens=5, grammar=grammar)
    fine = SamplingParams(temperature=0, max_tokens=5)
    pieces = run(default_engine, {"dead": ("Hello", dead), "fine": ("Hello", fine)})
    [refused] = pieces["dead"]
    assert refused.finish_reason == "error" and refused.invalid == "grammar"
    assert "no text can follow the grammar" in refused.error
    assert pieces["fine"][-1].finish_reason == "length" and text_of(pieces["fine"])


def test_a_grammar_whose_text_reaches_a_dead_end_ends_with_an_error_never_a_stop(default_engine):
    # "ab" is allowed, then nothing: llguidance's mask after it allows EOS alone and its matcher is in
    # error. Taking that EOS, the row would end as a "stop" whose text does not follow the grammar.
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "ab" b\nb: b')
    params = SamplingParams(temperature=0, max_tokens=5, grammar=grammar)
    pieces = run(default_engine, {"r": ("Hello", params)})["r"]
    assert text_of(pieces) == "ab"
    assert pieces[-1].finish_reason == "error" and pieces[-1].invalid == "grammar"
    assert "allows no token after the text so far" in pieces[-1].error


def test_a_grammar_complete_at_its_start_is_not_refused(default_engine):
    empty = SamplingParams(
        temperature=0, max_tokens=5, grammar=llguidance.LLMatcher.grammar_from_lark('start: ""')
    )
    [answer] = run(default_engine, {"r": ("Hello", empty)}).values()
    assert answer[-1].finish_reason == "stop" and text_of(answer) == ""


def test_the_masks_loop_and_pytorchs_operations_set_to_minus_inf_exactly_the_tokens_a_mask_clears():
    """Masks.apply by the fused operations' loop (fused_ops.cpp, `mask_disallowed`: float32 logits
    on a CPU) and by PyTorch's operations (a GPU, a machine without the extension), against each token's
    bit read one at a time: on words that allow all, none and some of their tokens, a vocabulary that
    ends inside a word, rows in another order than the mask's lines, and a row without a grammar, which
    keeps its logits (a +inf and a NaN among them, kept as they are where allowed)."""
    from backend.kernels.extension import extension
    from backend.layers import grammar

    vocab, words = 1000, 32  # 1,024 bits a line: the last word reaches past the vocabulary
    generator = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31, (5, words), dtype=torch.int32, generator=generator)
    bitmask[0, :10], bitmask[1, 10:20] = -1, 0  # whole words allowed, whole words not
    masks = grammar.Masks({7: 0, 2: 1, 9: 4}, bitmask)
    row_indexes = [9, 3, 7, 2]  # row 3 has no grammar
    logits = torch.randn(4, vocab, generator=generator)
    logits[:, 5], logits[:, 6] = float("inf"), float("nan")
    expected = logits.clone()
    for i, row in enumerate(row_indexes):
        if row in masks.rows:
            line = bitmask[masks.rows[row]]
            for token in range(vocab):
                if not (int(line[token // 32]) >> (token % 32)) & 1:
                    expected[i, token] = float("-inf")
    assert 0 < torch.isinf(expected[[0, 2, 3]]).float().mean() < 1  # some tokens of each masked row, not all
    assert extension() is not None and grammar._mask_loop(logits) is extension().mask_disallowed
    by_the_loop = logits.clone()
    masks.apply(by_the_loop, row_indexes)
    by_pytorch = logits.clone()
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(grammar, "_mask_loop", lambda logits: None)
        masks.apply(by_pytorch, row_indexes)
    for got in (by_the_loop, by_pytorch):
        assert torch.allclose(got, expected, equal_nan=True)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))


def test_masks_for_a_cpus_forward_pass_and_for_a_gpus_are_the_same(default_engine):
    """A CPU's step computes its rows' masks one after another in the engine's thread, a GPU's in
    llguidance's threads: both give each constrained row the mask of where its matcher stands (here
    rows at three places in one schema, and a row without a grammar between them, which gets none)."""
    from backend.layers.grammar import Grammars

    engine = default_engine
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_ids, 4)
    text = engine.tokenizer.encode('{"name": "Ada", "age": 36, "colour": "red", "tags": []}')
    for row, taken in ((0, 0), (2, 4), (3, 9)):
        matcher = grammars.matcher(json_schema(PERSON))
        assert all(matcher.consume_token(token) for token in text[:taken])
        grammars.attach(row, matcher)
    by_line = {}
    for device in ("cpu", "cuda"):  # the device's type alone chooses; nothing runs on it
        masks = grammars.masks([3, 1, 0, 2], torch.device(device))
        assert masks.rows == {3: 0, 0: 1, 2: 2}
        by_line[device] = masks.bitmask[:3].clone()
        masks.bitmask.zero_()
    assert torch.equal(by_line["cpu"], by_line["cuda"])
    allowed = [
        set(torch.nonzero(bits_of(line, engine.vocab_size)).flatten().tolist()) for line in by_line["cpu"]
    ]
    assert {engine.tokenizer.decode([token])[0] for token in allowed[1]} == {"{"}  # the object's start
    assert len(set(map(frozenset, allowed))) == 3  # three places, three masks


def bits_of(line: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask line's bits, token by token."""
    return ((line.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]


def test_a_tokenizer_with_more_tokens_than_the_vocabulary_refuses_grammars_and_keeps_serving():
    """A tokenizer one token larger than the model's vocabulary (a token added without resizing the
    embeddings), which llguidance cannot take: a request with a grammar is refused as its own fault, and
    the engine goes on serving the others (it had ended the backend process, every row's work lost)."""
    from backend.engine.engine import Engine
    from tests.backend.models import byte_tokenizer, tiny_model

    tokenizer = byte_tokenizer(("<|endoftext|>",))
    tokenizer.add_tokens(["<added>"])
    assert len(tokenizer) == 513
    engine = Engine(tiny_model("qwen2"), tokenizer, rows=2, max_seq_len=64)
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "ab"')
    constrained = SamplingParams(temperature=0, max_tokens=5, grammar=grammar)
    free = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    pieces = drive(
        engine, [(0, Submit("constrained", (5, 6), constrained)), (0, Submit("free", (5, 6), free))]
    )
    [refused] = pieces["constrained"]
    assert refused.finish_reason == "error" and refused.invalid == "grammar"
    assert "tokenizer cannot be used for grammars" in refused.error
    assert pieces["free"][-1].finish_reason == "length" and pieces["free"][-1].completion_tokens == 5
