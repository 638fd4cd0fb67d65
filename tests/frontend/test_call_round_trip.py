"""Every call a format's `auto` grammar lets a model write reads back as that call: random walks through
each format's grammar (tool_calls.ToolRequest.grammar, its tags as the router finds them in a tokenizer
that has every format's tags as tokens), from the tag that opens the calls to an end the grammar takes,
then through the format's reader (ToolCallReader). The tool's name and its parameters' names are ones a
schema may well have (`get-weather`, `user-id`, `first name`, `$ref`, `from`, CJK): the grammar writes
them as they are, and the reader must read them so; each value is whatever the grammar allowed, random.

Seeded, so that a failure is the same walk each time; the walks a format's grammar has no end for within
their steps are left out (a string's free text may run on)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import pytest

from backend.messages import BackendReady
from inference_api.chat_template import load_chat_template
from inference_api.router import Serving
from inference_api.tokenizer import ModelTokenizer
from inference_api.tool_calls import PARSER_ALIASES, TOOL_CALL_PARSERS, ToolCallReader, ToolRequest
from tests.backend.models import byte_tokenizer

# Each format's tag that opens its calls, or the character that does (Llama 3's JSON, `pythonic`)
OPENINGS = {
    "hermes": "<tool_call>",
    "llama3_json": "{",
    "pythonic": "[",
    "qwen3_coder": "<tool_call>",
    "glm45": "<tool_call>",
    "seed_oss": "<seed:tool_call>",
    "minimax_m2": "<minimax:tool_call>",
    "gemma4": "<|tool_call>",
    "functiongemma": "<start_function_call>",
    "mistral": "[TOOL_CALLS]",
    "granite": "<|tool_call|>",
    "deepseek_v3": "<｜tool▁calls▁begin｜>",
    "deepseek_v31": "<｜tool▁calls▁begin｜>",
    "lfm2": "<|tool_call_start|>",
    "jamba": "<tool_calls>",
    "nemotron_nano_v2": "<TOOLCALL>",
    "phi4_mini": "<|tool_call|>",
    "cohere_command4": "<|START_ACTION|>",
}
# Every format's tags as special tokens of one byte-level tokenizer; the EOS last
TAGS = (
    *("<tool_call>", "</tool_call>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>"),
    *("<start_function_call>", "<start_function_response>"),
    *("<end_function_call>", "<escape>", "[TOOL_CALLS]", "[ARGS]", "<|tool_call|>", "<|/tool_call|>"),
    *(
        "<tool_calls>",
        "</tool_calls>",
        "<TOOLCALL>",
        "</TOOLCALL>",
        "<|tool_call_start|>",
        "<|tool_call_end|>",
    ),
    *("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    *("<｜tool▁calls▁end｜>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    *("<|START_THINKING|>", "<|END_THINKING|>", "<|endoftext|>"),
)
NAMES = [
    "city",
    "user-id",
    "first name",
    "a.b",
    "$ref",
    "@type",
    "from",
    "class",
    "2fa",
    "é",
    "日本",
    "x" * 80,
]
VALUES = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"}, {"type": "object"}]
WALKS, STEPS = 8, 400


def test_every_format_has_its_opening_here():
    assert set(OPENINGS) == set(TOOL_CALL_PARSERS) - {"auto", *PARSER_ALIASES}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory):
    """The tokenizer as transformers has it (to walk and decode), and as the server loads it."""
    model = byte_tokenizer(TAGS)
    directory: Path = tmp_path_factory.mktemp("tags")
    model.save_pretrained(directory)
    return model, ModelTokenizer(str(directory))


def random_tool(rng: random.Random) -> dict:
    names = rng.sample(NAMES, rng.randint(1, 3))
    properties = {name: dict(rng.choice(VALUES)) for name in names}
    if rng.random() < 0.3:
        properties[names[0]] = {"enum": ["a b", "ü", "x=y"]}
    schema = {"type": "object", "properties": properties, "required": names}
    return {
        "type": "function",
        "function": {"name": rng.choice(["get-weather", "f", "9x"]), "parameters": schema},
    }


def walk(matcher: llguidance.LLMatcher, rng: random.Random, eos: int) -> list[int] | None:
    """Random tokens the grammar allows until it may end (then it ends, at even odds); None if it did not
    end within STEPS."""
    written = []
    for _ in range(STEPS):
        allowed = np.nonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8))[0]
        if matcher.is_accepting() and (rng.random() < 0.5 or list(allowed) == [eos]):
            return written
        token = int(rng.choice([token for token in allowed if token != eos]))
        if not matcher.consume_token(token):
            return None
        written.append(token)
    return None


@pytest.mark.parametrize("parser", list(OPENINGS))
def test_a_call_the_grammar_lets_the_model_write_reads_back_as_that_call(tokenizers, parser):
    model, tokenizer = tokenizers
    ready = BackendReady("tags", rows=1, max_seq_len=512, tokenizer_path=None, device="cpu", dtype="-")
    serving = Serving(ready, tokenizer, load_chat_template(None), tool_call_parser=parser)
    llg_tokenizer = llguidance.hf.from_tokenizer(model)
    eos = model.convert_tokens_to_ids("<|endoftext|>")
    rng = random.Random(parser)
    read_back = 0
    for _ in range(WALKS):
        tool = random_tool(rng)
        request = ToolRequest([tool], "auto", parser=serving.tool_parser, call_tags=serving.call_tags)
        matcher = llguidance.LLMatcher(llg_tokenizer, request.grammar, log_level=0)
        opening = model.encode(OPENINGS[parser], add_special_tokens=False)
        assert matcher.try_consume_tokens(opening) == len(opening), "the grammar does not open a call"
        written = walk(matcher, rng, eos)
        if written is None:
            continue
        text = model.decode(opening + written, skip_special_tokens=False)
        reader = ToolCallReader(request)
        reader.feed(text)
        _, calls = reader.finish()
        assert calls, text
        for call in calls:
            assert call["function"]["name"] == tool["function"]["name"], text
            arguments = json.loads(call["function"]["arguments"])
            assert set(arguments) == set(tool["function"]["parameters"]["properties"]), text
        read_back += 1
    assert read_back >= 2  # walks that end: the test reads calls, not nothing
