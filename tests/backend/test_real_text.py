"""Real text from the default model: stop sequences, multi-byte characters, seeds."""

import copy
import random
from unittest import mock

from backend.messages import SamplingParams, Submit
from tests.backend.models import drive, reference_greedy, text_of

REPLACEMENT_CHAR = "\ufffd"


def greedy(default_engine, request_id, text, max_tokens, stop=()):
    prompt = tuple(default_engine.tokenizer(text).input_ids)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
    return drive(default_engine, [(0, Submit(request_id, prompt, params))])[request_id]


def test_a_stop_sequence_spanning_tokens_ends_the_text_before_it(default_engine):
    tokenizer = default_engine.tokenizer
    prompt = "Once upon a time, in a land far away,"
    full = text_of(greedy(default_engine, "full", prompt, 40))
    generated = reference_greedy(
        default_engine.model, tokenizer(prompt).input_ids, 40, default_engine.eos_ids
    )
    # A stop made of the end of token 10 and the start of token 11.
    before = tokenizer.decode(generated[:10])
    boundary = len(before)
    stop = full[boundary - 2 : boundary + 3]
    assert tokenizer.decode(generated[10:11]) != stop
    pieces = greedy(default_engine, "stopped", prompt, 40, stop=(stop,))
    text = text_of(pieces)
    assert text == full[: full.index(stop)]
    assert pieces[-1].finish_reason == "stop"
    assert all(stop not in piece.text for piece in pieces)


def test_multibyte_text_streams_whole_characters_and_joins_to_the_whole_text(default_engine):
    tokenizer = default_engine.tokenizer
    prompt = "日本の首都は東京です。🍣と🍜が好きです。日本語で自己紹介をしてください:"
    pieces = greedy(default_engine, "ja", prompt, 60)
    generated = reference_greedy(
        default_engine.model, tokenizer(prompt).input_ids, 60, default_engine.eos_ids
    )
    # The test means something only if some character was split across tokens.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([token]) for token in generated)
    assert all(REPLACEMENT_CHAR not in piece.text for piece in pieces)
    assert len(pieces) > 5
    # A character cut off by max_tokens is dropped, never sent as U+FFFD.
    assert text_of(pieces) == tokenizer.decode(generated, skip_special_tokens=True).rstrip(REPLACEMENT_CHAR)


def test_emoji_split_over_byte_tokens_is_never_sent_in_halves(default_engine):
    tokenizer = default_engine.tokenizer
    emoji_ids = tokenizer("🍣🍜🎉").input_ids
    assert len(emoji_ids) > 3  # several byte-level tokens for three characters
    from backend.engine.detokenizer import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer("Food:").input_ids)
    pieces = [detokenizer.add(token) for token in emoji_ids]
    assert "".join(pieces) == "🍣🍜🎉"
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)


def test_the_detokenizers_decode_is_the_tokenizers_whichever_call_it_makes(default_engine):
    """The detokenizer calls the Rust tokenizer's decode straight where transformers' wrapper adds
    nothing to it (the default tokenizer), and the wrapper where it would clean up spaces; either way
    the text is the tokenizer's own, special tokens kept or skipped."""
    from backend.engine.detokenizer import IncrementalDetokenizer, decode_function

    tokenizer = default_engine.tokenizer
    ids = tokenizer("Hello, world! 🍣 It's <|im_end|> done .").input_ids + [tokenizer.eos_token_id]
    direct = decode_function(tokenizer)
    assert IncrementalDetokenizer(tokenizer, []).decode.__code__ is direct.__code__
    with mock.patch.object(type(tokenizer), "decode", side_effect=AssertionError("the wrapper")):
        texts = [direct(ids, skip) for skip in (True, False)]
    assert texts == [tokenizer.decode(ids, skip_special_tokens=skip) for skip in (True, False)]
    assert texts[0] != texts[1]

    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    with mock.patch.object(type(tokenizer), "decode", return_value="from the wrapper") as wrapper:
        assert decode_function(cleaning)(ids, True) == "from the wrapper"
    wrapper.assert_called_once_with(ids, skip_special_tokens=True)


def test_a_seeded_request_gives_the_same_text_alone_and_beside_31_others(default_engine):
    tokenizer = default_engine.tokenizer
    prompt = tuple(tokenizer("Write a short story about a lighthouse keeper:").input_ids)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=40)
    alone = text_of(drive(default_engine, [(0, Submit("seeded", prompt, params))])["seeded"])

    rng = random.Random(5)
    others = []
    for i in range(31):
        other_prompt = tuple(tokenizer(f"Tell me fact number {i} about the ocean.").input_ids)
        other_params = SamplingParams(
            temperature=rng.choice([0, 0.5, 1.0, 1.3]),
            top_k=rng.choice([0, 10, 100]),
            top_p=rng.choice([0.8, 1.0]),
            seed=rng.choice([None, i]),
            max_tokens=rng.randrange(5, 50),
        )
        others.append((rng.randrange(0, 4), Submit(f"other{i}", other_prompt, other_params)))
    crowded = drive(default_engine, [*others, (2, Submit("seeded", prompt, params))])
    assert text_of(crowded["seeded"]) == alone
    assert len(crowded) == 32

    other_seed = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4321, max_tokens=40)
    assert text_of(drive(default_engine, [(0, Submit("reseeded", prompt, other_seed))])["reseeded"]) != alone
