"""A reasoning model's thoughts apart from its answer (inference_api/reasoning.py), and the request's own
variables for the chat template (`chat_template_kwargs`).

The server runs the default model with Qwen3's real chat template (`--chat-template`) and
`--reasoning-parser qwen3`. SmolLM2 does not think by itself, so the requests that need thoughts have
them written under a `guided_regex`: the text is then known, while the tokens, the pieces they stream
in and the tags split across them are the real tokenizer's. The official `openai` client reads the
answers, as a user's code would (`reasoning_content` is one of its messages' extra fields).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
import requests
from tokenizers import Tokenizer, models, pre_tokenizers

from inference_api.reasoning import REASONING_PARSERS, ReasoningReader, opened_in_prompt, reads_reasoning
from inference_api.tokenizer import load_tokenizer
from tests.conftest import ROOT
from tests.frontend.test_openapi_e2e import documented
from tests.server_fixture import RunningServer, running_server

QWEN3_TEMPLATE = ROOT / "tests" / "frontend" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
MODEL = "SmolLM2-135M-Instruct"
GREETING = [{"role": "user", "content": "Hi! Who are you?"}]
THOUGHTS = "The user greets me.\n\nI greet them back."
ANSWER = "Hello there! I am a small model."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def forced(text: str) -> dict:
    """The request's extra fields that make the model write exactly `text`."""
    return {"guided_regex": re.escape(text)}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    options = ["--chat-template", str(QWEN3_TEMPLATE), "--reasoning-parser", "qwen3", "--rows", "4"]
    with running_server(*options, "--max-seq-len", "1024", ready_timeout=300) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_the_thoughts_come_apart_from_the_answer_whole_and_streamed(client):
    text = f"<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}"
    request = dict(model=MODEL, messages=GREETING, max_tokens=96, temperature=0, extra_body=forced(text))
    message = client.chat.completions.create(**request).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)

    kinds, thoughts, answer = [], "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        for kind in ("reasoning_content", "content"):
            if getattr(delta, kind, None):
                kinds.append(kind)
        thoughts += getattr(delta, "reasoning_content", None) or ""
        answer += delta.content or ""
    assert (thoughts, answer) == (THOUGHTS, ANSWER)
    # The thoughts stream as they come, in many deltas, all before the answer's.
    assert kinds.count("reasoning_content") > 3
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")


@pytest.mark.parametrize("stream", [False, True])
def test_answers_with_thoughts_are_as_the_openapi_document_says(server, stream):
    body = {
        "model": MODEL,
        "messages": GREETING,
        "max_tokens": 96,
        "temperature": 0,
        "stream": stream,
        "chat_template_kwargs": {"enable_thinking": True},
        **forced(f"<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}"),
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    documented(response, "post", "/v1/chat/completions")
    assert "reasoning_content" in response.text


def test_an_answer_cut_while_thinking_is_thoughts_only(client):
    text = f"<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}"
    choice = client.chat.completions.create(
        model=MODEL, messages=GREETING, max_tokens=9, temperature=0, extra_body=forced(text)
    ).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == ""
    assert choice.message.reasoning_content and THOUGHTS.startswith(choice.message.reasoning_content)


def test_an_answer_without_thoughts_is_all_content(client):
    message = (
        client.chat.completions.create(
            model=MODEL, messages=GREETING, max_tokens=32, temperature=0, extra_body=forced(ANSWER)
        )
        .choices[0]
        .message
    )
    assert message.content == ANSWER
    assert getattr(message, "reasoning_content", None) is None


def test_thoughts_before_a_tool_call_are_reasoning_and_the_call_is_read(client):
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    text = f"<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        max_tokens=96,
        temperature=0,
        extra_body=forced(text),
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather."
    assert choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}


def test_chat_template_kwargs_reach_the_template(client, server):
    """Qwen3's `enable_thinking: false` closes an empty block in the prompt: the prompt the request is
    answered from is /tokenize's for the same messages and kwargs, and longer than without them."""
    off = {"enable_thinking": False}

    def tokenized(**fields) -> list[int]:
        response = requests.post(f"{server.url}/tokenize", json={"messages": GREETING, **fields}, timeout=30)
        response.raise_for_status()
        return response.json()["tokens"]

    plain, thinking_off = tokenized(), tokenized(chat_template_kwargs=off)
    assert len(thinking_off) > len(plain)
    detokenized = requests.post(f"{server.url}/detokenize", json={"tokens": thinking_off}, timeout=30).json()
    assert detokenized["prompt"].endswith("<think>\n\n</think>\n\n")

    completion = client.chat.completions.create(
        model=MODEL,
        messages=GREETING,
        max_tokens=32,
        temperature=0,
        extra_body={"chat_template_kwargs": off, **forced(ANSWER)},
    )
    assert completion.usage.prompt_tokens == len(thinking_off)
    assert completion.choices[0].message.content == ANSWER


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"messages": []}, "may not set 'messages'"),
        ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
        (["enable_thinking"], "must be an object"),
    ],
)
def test_chat_template_kwargs_that_the_server_sets_or_that_are_not_an_object_are_a_400(client, kwargs, says):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=GREETING, max_tokens=4, extra_body={"chat_template_kwargs": kwargs}
        )
    assert raised.value.body["param"] == "chat_template_kwargs"
    assert says in raised.value.body["message"]


def test_a_template_that_refuses_the_kwargs_is_a_400_and_the_server_goes_on(client):
    """A kwarg that the template calls as a function makes it fail: a 400, as any refusal of its."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL,
            messages=GREETING,
            max_tokens=4,
            extra_body={"chat_template_kwargs": {"namespace": 3}},
        )
    assert "chat template refused" in raised.value.body["message"]
    message = (
        client.chat.completions.create(
            model=MODEL, messages=GREETING, max_tokens=32, temperature=0, extra_body=forced(ANSWER)
        )
        .choices[0]
        .message
    )
    assert message.content == ANSWER


def write_tokenizer(directory, added: list[str]):
    """A word-level tokenizer of a few words, `added` tokens of their own, as the frontend loads one."""
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "<": 2, ">": 3}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_tokens(added)
    tokenizer.save(str(directory / "tokenizer.json"))
    return load_tokenizer(str(directory))


def test_auto_reads_thoughts_where_the_tags_are_tokens_and_the_template_writes_them(tmp_path):
    (tmp_path / "tags").mkdir()
    (tmp_path / "plain").mkdir()
    tags = write_tokenizer(tmp_path / "tags", ["<think>", "</think>"])
    plain = write_tokenizer(tmp_path / "plain", [])
    thinking_template = QWEN3_TEMPLATE.read_text()
    chatml = (ROOT / "tests" / "frontend" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert reads_reasoning("auto", tags, thinking_template)
    assert not reads_reasoning("auto", tags, chatml)  # no thinking in the template
    assert not reads_reasoning("auto", plain, thinking_template)  # the tags are text, not tokens
    assert not reads_reasoning("none", tags, thinking_template)
    for named in set(REASONING_PARSERS) - {"auto", "none"}:
        assert reads_reasoning(named, plain, chatml)


def test_a_prompt_that_opens_the_block_starts_the_answer_in_thoughts(tmp_path):
    tokenizer = write_tokenizer(tmp_path, ["<think>", "</think>", "\n"])

    def opens(prompt: str) -> bool:
        return opened_in_prompt(tokenizer.encode(prompt, add_special_tokens=False), tokenizer)

    assert opens("hello <think>\n")
    assert not opens("hello <think>\n\n</think>\n")
    assert not opens("hello")
    reader = ReasoningReader(opened_in_prompt=True)
    said = [reader.feed(piece) for piece in ("\nI plan", ".\n</thi", "nk>\n\nDone")] + [reader.finish()]
    assert ("".join(r for r, _ in said), "".join(c for _, c in said)) == ("I plan.", "Done")


@pytest.mark.parametrize(
    ("text", "thoughts", "content"),
    [
        ("<think>\nA.\n\nB.\n</think>\n\nHi", "A.\n\nB.", "Hi"),
        ("\n<think>A</think>Hi", "A", "Hi"),
        ("Hi <think>A</think>", "", "Hi <think>A</think>"),  # only a block that opens the answer
        ("<thi", "", "<thi"),  # an answer that ends where a tag might have begun is text
        ("<think>A</thi", "A</thi", ""),
        ("<b>Hi</b>", "", "<b>Hi</b>"),
        ("\n\nHi", "", "\n\nHi"),
    ],
)
def test_the_reader_splits_the_same_however_the_text_is_cut(text, thoughts, content):
    for size in range(1, len(text) + 1):
        reader = ReasoningReader()
        said = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)] + [reader.finish()]
        assert ("".join(r for r, _ in said), "".join(c for _, c in said)) == (thoughts, content), size
