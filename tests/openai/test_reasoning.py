"""A reasoning model's thoughts apart from its answer (inference_api/reasoning.py) on every chat API, and
the request's own variables for the chat template (`chat_template_kwargs`, Anthropic's `thinking`,
the Responses API's `reasoning`).

The server (tests/reasoning_server.py) serves the default model with Qwen3's chat template edited to
open the `<think>` block in the prompt: SmolLM2's greedy text is then all thoughts. Where a test needs
the thoughts to end, a `guided_regex` writes them, so that the text is known while the tokens, the
pieces they stream in and the tags split across them are the real tokenizer's. The official `openai`
and `anthropic` clients read the answers, as a user's code would.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import llguidance
import llguidance.hf
import openai
import pytest
import requests
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from backend.model.loader import converted_dir
from backend.model.source import resolve_model
from inference_api.reasoning import (
    CLOSED,
    COHERE_THOUGHTS,
    GEMMA4_TAGS,
    GEMMA4_THOUGHTS,
    MISTRAL_TAGS,
    MISTRAL_THOUGHTS,
    NEITHER,
    OPENED,
    REASONING_PARSERS,
    THINK_BLOCKS,
    ReasoningReader,
    after_thoughts,
    prompt_end,
    reasoning_format,
)
from inference_api.structured_output import json_schema_grammar
from inference_api.tokenizer import load_tokenizer
from tests.frontend.test_openapi_e2e import documented
from tests.openai.test_tool_calls import WEATHER
from tests.reasoning_server import TEMPLATES, reasoning_server
from tests.server_fixture import RunningServer

MODEL = "SmolLM2-135M-Instruct"
GREETING = [{"role": "user", "content": "Hi! Who are you?"}]
THOUGHTS = "The user greets me.\n\nI greet them back."
ANSWER = "Hello there! I am a small model."
NO_THINKING = {"enable_thinking": False}


def forced(text: str) -> dict:
    """The request's extra fields that make the model write exactly `text`."""
    return {"guided_regex": re.escape(text)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with reasoning_server(tmp_path_factory.mktemp("template")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return server.anthropic_client()


def test_the_thoughts_come_apart_from_the_answer_whole_and_streamed(client, llguidance_tokenizer):
    text = f"{THOUGHTS}\n</think>\n\n{ANSWER}"  # the prompt opened the block
    request = dict(model=MODEL, messages=GREETING, max_tokens=96, temperature=0, extra_body=forced(text))
    completion = client.chat.completions.create(**request)
    message = completion.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)
    # The thoughts' tokens, counted again from their text (the tags not counted).
    thought_tokens = len(llguidance_tokenizer[0].encode(THOUGHTS, add_special_tokens=False))
    assert completion.usage.completion_tokens_details.reasoning_tokens == thought_tokens

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
        **forced(f"{THOUGHTS}\n</think>\n\n{ANSWER}"),
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    documented(response, "post", "/v1/chat/completions")
    assert "reasoning_content" in response.text


def test_an_answer_cut_while_thinking_is_thoughts_only(client):
    text = f"{THOUGHTS}\n</think>\n\n{ANSWER}"
    choice = client.chat.completions.create(
        model=MODEL, messages=GREETING, max_tokens=9, temperature=0, extra_body=forced(text)
    ).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == ""
    assert choice.message.reasoning_content and THOUGHTS.startswith(choice.message.reasoning_content)


def test_with_thinking_off_the_answer_is_content_unless_the_model_opens_a_block(client):
    """Qwen3's `enable_thinking: false` closes an empty block in the prompt: the answer is content, but
    a block the model opens itself is still its thoughts."""
    request = dict(model=MODEL, messages=GREETING, max_tokens=96, temperature=0)
    off = {"chat_template_kwargs": NO_THINKING}
    message = (
        client.chat.completions.create(**request, extra_body={**off, **forced(ANSWER)}).choices[0].message
    )
    assert message.content == ANSWER
    assert getattr(message, "reasoning_content", None) is None
    own_block = forced(f"<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}")
    message = client.chat.completions.create(**request, extra_body={**off, **own_block}).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)


def test_thoughts_before_a_tool_call_are_reasoning_and_the_call_is_read(client):
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})
    text = f"The user wants the weather.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        max_tokens=96,
        temperature=0,
        extra_body=forced(text),
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather."
    assert choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_chat_template_kwargs_reach_the_template(client, server):
    """The prompt a request is answered from is /tokenize's for the same messages and kwargs: with
    `enable_thinking: false`, longer than without, as it closes the block the prompt would open."""
    off = NO_THINKING

    def tokenized(**fields) -> list[int]:
        response = requests.post(f"{server.url}/tokenize", json={"messages": GREETING, **fields}, timeout=30)
        response.raise_for_status()
        return response.json()["tokens"]

    plain, thinking_off = tokenized(), tokenized(chat_template_kwargs=off)
    assert len(thinking_off) > len(plain)
    for tokens, end in ((plain, "<think>\n"), (thinking_off, "<think>\n\n</think>\n\n")):
        detokenized = requests.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()
        assert detokenized["prompt"].endswith("<|im_start|>assistant\n" + end)  # special tokens' texts kept

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
            model=MODEL,
            messages=GREETING,
            max_tokens=32,
            temperature=0,
            extra_body={"chat_template_kwargs": NO_THINKING, **forced(ANSWER)},
        )
        .choices[0]
        .message
    )
    assert message.content == ANSWER


def test_anthropic_messages_give_the_thoughts_as_a_thinking_block_whole_and_streamed(claude, server):
    asked = dict(model=MODEL, max_tokens=12, messages=GREETING, extra_body={"temperature": 0})
    message = claude.messages.create(**asked)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking and "<think>" not in thinking.thinking
    assert (text.type, text.text) == ("text", "")  # the 12 tokens were all thoughts
    assert message.stop_reason == "max_tokens"
    with claude.messages.stream(**asked) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [
        block.model_dump() for block in message.content
    ]
    assert kinds.count("thinking_delta") > 3
    for stream in (False, True):
        body = {"model": MODEL, "max_tokens": 12, "messages": GREETING, "temperature": 0, "stream": stream}
        response = requests.post(f"{server.url}/v1/messages", json=body, timeout=120)
        documented(response, "post", "/v1/messages")


def test_anthropic_thinking_sets_the_templates_variable_and_thinking_blocks_go_back_to_it(claude):
    def counted(**fields) -> int:
        return claude.messages.count_tokens(model=MODEL, **{"messages": GREETING, **fields}).input_tokens

    assert counted(thinking={"type": "disabled"}) > counted()  # the block closed in the prompt
    assert counted(thinking={"type": "enabled", "budget_tokens": 1024}) == counted()
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        counted(thinking={"type": "enabled", "budget_tokens": 100})
    # A tool-use loop sends the thoughts back: Qwen3's template keeps those after the last question.
    weather = {
        "name": "get_weather",
        "description": "The weather.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    thought = {"type": "thinking", "thinking": "I should look the weather up.", "signature": ""}
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}],
    }
    question = {"role": "user", "content": "Weather in Paris?"}

    def loop(*blocks) -> int:
        return counted(
            messages=[question, {"role": "assistant", "content": list(blocks)}, result], tools=[weather]
        )

    assert loop(thought, call) > loop(call)


def test_the_responses_api_gives_the_thoughts_as_a_reasoning_item_whole_and_streamed(
    client, server, llguidance_tokenizer
):
    asked = dict(model=MODEL, input="Hi! Who are you?", max_output_tokens=12, temperature=0)
    response = client.responses.create(**asked)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
    [part] = reasoning.content
    assert part.type == "reasoning_text" and part.text and "<think>" not in part.text
    assert (message.type, message.content[0].text) == ("message", "")
    # The thoughts' tokens, counted again from their text: the 12 tokens but any whitespace dropped.
    thought_tokens = len(llguidance_tokenizer[0].encode(part.text, add_special_tokens=False))
    assert response.usage.output_tokens_details.reasoning_tokens == thought_tokens <= 12
    events = list(client.responses.create(**asked, stream=True))
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == part.text
    assert events[-1].response.output[0].content[0].text == part.text
    items = [
        (event.type, event.output_index) for event in events if event.type.startswith("response.output_item")
    ]
    assert items == [
        (f"response.output_item.{step}", index) for index in (0, 1) for step in ("added", "done")
    ]
    for stream in (False, True):
        answered = requests.post(f"{server.url}/v1/responses", json={**asked, "stream": stream}, timeout=120)
        documented(answered, "post", "/v1/responses")


# A call of the weather tool and its output, as Responses items: thoughts before them lead to the call, a
# turn whose thoughts the template keeps (it drops those of turns before the last user message).
PARIS_CALL = {
    "type": "function_call",
    "call_id": "c1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
PARIS_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "Sunny."}


def test_the_responses_apis_effort_none_turns_thinking_off_and_reasoning_items_go_back(client):
    off = client.responses.create(
        model=MODEL, input="Hi!", max_output_tokens=6, temperature=0, reasoning={"effort": "none"}
    )
    assert [item.type for item in off.output] == ["message"]
    assert off.reasoning.effort == "none"

    def prompt_tokens(*items) -> int:
        conversation = [{"role": "user", "content": "Weather in Paris?"}, *items]
        tool = {"type": "function", **WEATHER["function"]}
        answered = client.responses.create(
            model=MODEL,
            input=[*conversation, PARIS_CALL, PARIS_OUTPUT],
            tools=[tool],
            max_output_tokens=1,
            temperature=0,
        )
        return answered.usage.input_tokens

    thoughts = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "I should look it up."}],
    }
    assert prompt_tokens(thoughts) > prompt_tokens()


def test_the_thoughts_come_back_from_their_encrypted_content_where_include_asks_for_it(client, server):
    """What Codex and other stateless agents send: store false, include reasoning.encrypted_content,
    reasoning with summary auto. Nothing is stored here, so the item carries its thoughts themselves, and
    an item sent back with that field alone (its text parts dropped) is the same turn to the template."""
    asked = dict(
        model=MODEL,
        input="Weather in Paris?",
        max_output_tokens=12,
        temperature=0,
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium", "summary": "auto"},
    )
    reasoning = client.responses.create(**asked).output[0]
    sealed = reasoning.encrypted_content
    assert reasoning.type == "reasoning" and sealed.startswith("inference-server:thoughts:")
    events = list(client.responses.create(**asked, stream=True))
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert done[0].encrypted_content == events[-1].response.output[0].encrypted_content == sealed
    plain = client.responses.create(**{**asked, "include": []}).output[0]
    assert plain.encrypted_content is None and plain.content == reasoning.content

    def prompt_tokens(thoughts: dict | None) -> int | str:
        """The input's tokens with these thoughts before a call (a turn whose thoughts the template keeps),
        or the param of the 400."""
        items = [
            {"role": "user", "content": "Weather in Paris?"},
            *([thoughts] if thoughts else []),
            PARIS_CALL,
            PARIS_OUTPUT,
        ]
        tools = [{"type": "function", **WEATHER["function"]}]
        body = {"model": MODEL, "input": items, "tools": tools, "max_output_tokens": 1, "temperature": 0}
        answered = requests.post(f"{server.url}/v1/responses", json=body, timeout=120)
        return answered.json()["usage"]["input_tokens"] if answered.ok else answered.json()["error"]["param"]

    whole = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Look it up."}],
    }
    sealed_only = {"type": "reasoning", "summary": [], "encrypted_content": sealed}
    with_text = {**sealed_only, "content": [{"type": "reasoning_text", "text": reasoning.content[0].text}]}
    assert prompt_tokens(sealed_only) == prompt_tokens(with_text) > prompt_tokens(None)
    assert prompt_tokens({**whole, "encrypted_content": "gAAAAABo-opaque"}) == prompt_tokens(whole)
    openais = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo-opaque"}
    assert prompt_tokens(openais) == prompt_tokens(None)  # another server's: nothing to read
    tampered = {**sealed_only, "encrypted_content": "inference-server:thoughts:%%%"}
    assert prompt_tokens(tampered) == "input[1].encrypted_content"
    for detailed in ({"summary": "detailed"}, {"generate_summary": "concise"}):
        refused = requests.post(
            f"{server.url}/v1/responses", json={**asked, "stream": False, "reasoning": detailed}, timeout=30
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("reasoning.")


MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}


def test_a_json_format_constrains_the_answer_after_the_thoughts(client):
    """As vLLM applies structured outputs once the reasoning ends: the thoughts are free text (SmolLM2's
    never end), and with thinking off the answer is the JSON at once."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "How do you feel?"}], temperature=0)
    mood = {"type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD}}
    thinking = client.chat.completions.create(**request, max_tokens=24, response_format=mood).choices[0]
    assert thinking.finish_reason == "length" and thinking.message.content == ""
    assert not thinking.message.reasoning_content.startswith("{")  # free text, not the schema's JSON
    vllms = {"structured_outputs": {"json": MOOD}}  # vLLM's field for the same: it waits for the thoughts too
    same = client.chat.completions.create(**request, max_tokens=24, extra_body=vllms).choices[0]
    assert same.message.reasoning_content == thinking.message.reasoning_content
    off = {"chat_template_kwargs": NO_THINKING}
    answer = client.chat.completions.create(**request, max_tokens=24, response_format=mood, extra_body=off)
    assert json.loads(answer.choices[0].message.content)["mood"] in ("happy", "sad")
    assert getattr(answer.choices[0].message, "reasoning_content", None) is None


def test_a_forced_tool_call_with_thinking_off_is_the_answer(client):
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
        extra_body={"chat_template_kwargs": NO_THINKING},
    ).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert getattr(choice.message, "reasoning_content", None) is None


@pytest.fixture(scope="module")
def llguidance_tokenizer(server):
    """The default model's tokenizer as the backend's grammars see it (from the server's converted copy)."""
    tokenizer = AutoTokenizer.from_pretrained(
        converted_dir(resolve_model(None), Path(os.environ["INFERENCE_CACHE_DIR"]))
    )
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


@pytest.mark.parametrize(
    ("opened", "text", "takes"),
    [
        (True, 'I think {"mood"\n</think>\n\n{"mood": "sad"}', True),
        (True, 'Hm.</think>{"mood": "happy"}', True),
        (True, "Hm.</think>\n\nhappy", False),  # after the thoughts, the schema's JSON only
        (True, '{"mood": "sad"}', False),  # still thoughts: the block has not ended
        (False, '{"mood": "sad"}', True),  # the model need not think
        (False, '<think>\nHm.\n</think>\n\n{"mood": "sad"}', True),
        (False, "<think>Hm.</think>sad", False),
        (False, "Hm.", False),
    ],
)
def test_the_thoughts_grammar_frees_the_thoughts_and_holds_the_answer(
    llguidance_tokenizer, opened, text, takes
):
    tokenizer, tokens = llguidance_tokenizer
    matcher = llguidance.LLMatcher(
        tokens, after_thoughts(json_schema_grammar(MOOD, "schema"), opened), log_level=0
    )
    consumed = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert (consumed and matcher.is_accepting()) == takes


@pytest.mark.parametrize(
    ("opened", "text", "takes"),
    [
        (False, '{"mood": "sad"}', True),
        (False, '<|channel>thought\nHm, {"mood"<channel|>{"mood": "sad"}', True),
        (False, '<|channel>thought\n<channel|>\n{"mood": "happy"}', True),
        (False, "<|channel>thought\nHm.<channel|>sad", False),
        (False, '<|channel>Hm.<channel|>{"mood": "sad"}', False),  # the channel is the thoughts' only
        (True, 'Hm.<channel|>{"mood": "sad"}', True),
        (True, '{"mood": "sad"}', False),  # still thoughts: the block has not ended
    ],
)
def test_gemma_4s_thoughts_grammar_names_its_tags_as_tokens(opened, text, takes):
    from tests.backend.models import byte_tokenizer

    tokenizer = byte_tokenizer(("<|channel>", "<channel|>", "<turn|>"))
    grammar = after_thoughts(json_schema_grammar(MOOD, "schema"), opened, GEMMA4_TAGS)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == takes


MISTRAL_TOKENS = ("[INST]", "[/INST]", "[THINK]", "[/THINK]", "</s>")


@pytest.mark.parametrize(
    ("opened", "text", "takes"),
    [
        (False, '{"mood": "sad"}', True),
        (False, '[THINK]Hm, {"mood"[/THINK]{"mood": "sad"}', True),
        (False, '[THINK][/THINK]\n{"mood": "happy"}', True),
        (False, "[THINK]Hm.[/THINK]sad", False),
        (False, '[/THINK]{"mood": "sad"}', False),  # a block closed that never opened
        (True, 'Hm.[/THINK]{"mood": "sad"}', True),
        (True, '{"mood": "sad"}', False),  # still thoughts: the block has not ended
    ],
)
def test_mistrals_thoughts_grammar_names_its_tags_by_their_ids(tmp_path, opened, text, takes):
    """Mistral's [THINK] tags are special tokens that llguidance cannot name by their text (it names
    only `<...>` ones): the grammar names them by id."""
    from tests.backend.models import byte_tokenizer

    tokenizer = byte_tokenizer(MISTRAL_TOKENS)
    tokenizer.save_pretrained(tmp_path)
    grammar = after_thoughts(
        json_schema_grammar(MOOD, "schema"), opened, MISTRAL_TAGS, load_tokenizer(str(tmp_path))
    )
    assert f"<[{tokenizer.convert_tokens_to_ids('[/THINK]')}]>" in grammar  # by id, not by its text
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == takes


def test_auto_reads_mistrals_think_blocks_where_its_tags_are_tokens_and_the_template_writes_them(tmp_path):
    (tmp_path / "tags").mkdir()
    (tmp_path / "think").mkdir()
    tags = write_tokenizer(tmp_path / "tags", ["[THINK]", "[/THINK]"])
    think = write_tokenizer(tmp_path / "think", ["<think>", "</think>"])
    magistral = "{{- '[SYSTEM_PROMPT]Draft your thinking between [THINK] and [/THINK].[/SYSTEM_PROMPT]' }}"
    assert reasoning_format("auto", tags, magistral) == MISTRAL_THOUGHTS
    assert reasoning_format("auto", think, magistral) is None  # the tags are text, not tokens
    assert reasoning_format("auto", tags, "{{- '[INST]' + message.content }}") is None  # no thoughts written
    assert reasoning_format("mistral", think, magistral) == MISTRAL_THOUGHTS
    assert prompt_end(tags.encode("hello [THINK]", add_special_tokens=False), tags, MISTRAL_TAGS) == OPENED
    assert prompt_end(tags.encode("hello", add_special_tokens=False), tags, MISTRAL_TAGS) == NEITHER


@pytest.mark.parametrize(
    ("text", "thoughts", "content"),
    [
        ("[THINK]A.\n\nB.[/THINK]Hi", "A.\n\nB.", "Hi"),
        ("[THINK][/THINK]\n\nHi", "", "Hi"),
        ("[THIN", "", "[THIN"),
        ("[THINK]A[/TH", "A[/TH", ""),
        ("<think>A</think>Hi", "", "<think>A</think>Hi"),  # another model's tags are text
    ],
)
def test_the_reader_splits_mistrals_think_blocks_however_the_text_is_cut(text, thoughts, content):
    assert_split_however_cut(lambda: ReasoningReader(tags=MISTRAL_TAGS), text, thoughts, content)


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
    thinking_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    chatml = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert reasoning_format("auto", tags, thinking_template) == THINK_BLOCKS
    assert reasoning_format("auto", tags, chatml) is None  # no thinking in the template
    assert reasoning_format("auto", plain, thinking_template) is None  # the tags are text, not tokens
    assert reasoning_format("none", tags, thinking_template) is None
    for named in set(REASONING_PARSERS) - {
        "auto",
        "none",
        "gemma4",
        "mistral",
        "openai_gptoss",
        "cohere_command4",
    }:  # test_harmony.py: gpt-oss's
        assert reasoning_format(named, plain, chatml) == THINK_BLOCKS
    assert reasoning_format("gemma4", plain, chatml) == GEMMA4_THOUGHTS
    assert reasoning_format("cohere_command4", plain, chatml) == COHERE_THOUGHTS


def test_auto_reads_gemma_4s_thought_channel_where_its_tags_are_tokens(tmp_path):
    (tmp_path / "tags").mkdir()
    (tmp_path / "think").mkdir()
    tags = write_tokenizer(tmp_path / "tags", ["<|channel>", "<channel|>"])
    think = write_tokenizer(tmp_path / "think", ["<think>", "</think>"])
    gemma4 = (
        "{{- '<|turn>model\n' }}{% if not enable_thinking %}{{- '<|channel>thought\n<channel|>' }}{% endif %}"
    )
    assert reasoning_format("auto", tags, gemma4) == GEMMA4_THOUGHTS
    assert reasoning_format("auto", think, gemma4) is None  # the tags are text, not tokens
    assert reasoning_format("auto", tags, "{{- '<|turn>model\n' }}") is None  # no thoughts in the template


def test_the_prompts_end_says_where_the_answer_starts(tmp_path):
    tokenizer = write_tokenizer(tmp_path, ["<think>", "</think>", "\n"])

    def end(prompt: str) -> str:
        return prompt_end(tokenizer.encode(prompt, add_special_tokens=False), tokenizer)

    assert end("hello <think>\n") == OPENED
    assert end("hello <think>\n\n</think>\n") == CLOSED
    assert end("hello") == NEITHER
    from tests.backend.models import byte_tokenizer

    gemma4 = byte_tokenizer(("<|channel>", "<channel|>", "<turn|>"))

    def gemma4_end(prompt: str) -> str:
        return prompt_end(gemma4.encode(prompt, add_special_tokens=False), gemma4, GEMMA4_TAGS)

    assert gemma4_end("hello <|channel>thought\n") == OPENED
    assert gemma4_end("hello <|channel>thought\n<channel|>") == CLOSED
    assert gemma4_end("hello <think>\n") == NEITHER
    reader = ReasoningReader(opened=True)
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
    assert_split_however_cut(ReasoningReader, text, thoughts, content)


@pytest.mark.parametrize(
    ("text", "thoughts", "content"),
    [
        ("<|channel>thought\nA.\n\nB.<channel|>Hi", "A.\n\nB.", "Hi"),
        ("<|channel>thought\n<channel|>Hi", "", "Hi"),  # the empty block a closed prompt's model may write
        ("<|channel>thoug", "", "<|channel>thoug"),
        ("<|channel>thought\nA<chan", "A<chan", ""),
        ("<think>A</think>Hi", "", "<think>A</think>Hi"),  # another model's tags are text
    ],
)
def test_the_reader_splits_gemma_4s_thought_channel_however_the_text_is_cut(text, thoughts, content):
    assert_split_however_cut(lambda: ReasoningReader(tags=GEMMA4_TAGS), text, thoughts, content)


def assert_split_however_cut(new_reader, text: str, thoughts: str, content: str) -> None:
    """The text, fed in pieces of every size from 1 up, comes apart into `thoughts` and `content`."""
    for size in range(1, len(text) + 1):
        reader = new_reader()
        said = [reader.feed(text[i : i + size]) for i in range(0, len(text), size)] + [reader.finish()]
        assert ("".join(r for r, _ in said), "".join(c for _, c in said)) == (thoughts, content), size


def test_llama_stacks_chat_completion_gives_the_answer_without_the_thoughts(client, server):
    """Its message has no field for thoughts: the content is what chat's `content` is."""
    # Greedy (Llama Stack's default strategy), the model's own text after the prompt opened the block
    # is all thoughts: chat gives them as reasoning_content, Llama Stack's content none of them.
    body = {"model_id": MODEL, "messages": GREETING, "sampling_params": {"max_tokens": 12}}
    answered = requests.post(f"{server.url}/inference/chat_completion", json=body, timeout=120)
    assert answered.status_code == 200, answered.text
    assert answered.json()["completion_message"]["content"] == ""
    thoughts = client.chat.completions.create(model=MODEL, messages=GREETING, max_tokens=12, temperature=0)
    assert thoughts.choices[0].message.reasoning_content
