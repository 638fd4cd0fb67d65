"""Chat templates render exactly as transformers renders them (issue 15, item 2).

The real templates of a dozen model families (tests/frontend/chat_templates/,
README there says where each came from) are saved with a tokenizer as the
backend saves one, read back by the frontend's `load_chat_template`, and
rendered over several conversations; the text must equal
`tokenizer.apply_chat_template(..., tokenize=False)`, and a conversation a
template refuses must be refused by both, with the same message.

Together they use what transformers' Jinja environment adds: `loopcontrols`
(Command R7B's `break`), `tojson` with `indent` and non-ASCII text (Llama
3.x), `{% generation %}` (LFM2.5), `strftime_now` (Llama 3.2, gpt-oss),
`raise_exception` (Gemma, Mistral), `tools` and `documents` arguments.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from inference_api.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    UnusableChatTemplate,
    load_chat_template,
)
from tests.server_fixture import RunningServer, running_server

TEMPLATES = Path(__file__).parent / "chat_templates"

# Each family's special tokens, as its tokenizer_config.json names them.
SPECIAL_TOKENS: dict[str, dict[str, str]] = {
    "meta-llama-Llama-3.1-8B-Instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "meta-llama-Llama-3.2-3B-Instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "Qwen-Qwen2.5-7B-Instruct": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "Qwen-Qwen3-0.6B": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistralai-Mistral-Nemo-Instruct-2407": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "google-gemma-2-2b-it": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "microsoft-Phi-3.5-mini-instruct": {
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
    },
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
    },
    "deepseek-ai-DeepSeek-V3.1": {
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
    },
    "openai-gpt-oss-120b": {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
    },
    "HuggingFaceTB-SmolLM2-135M-Instruct": {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    },
    "HuggingFaceTB-SmolLM3-3B": {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": {
        "bos_token": "<BOS_TOKEN>",
        "eos_token": "<|END_OF_TURN_TOKEN|>",
        "pad_token": "<PAD>",
    },
    "LFM2.5-8B-A1B": {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "abc123XYZ",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
}
SYSTEM = {"role": "system", "content": "You are terse. Answer in <b>one</b> line & quote 'nothing'."}
USER = {"role": "user", "content": "What's the weather in Zürich? 日本語 too."}

# name: (messages, with tools, documents)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], bool, list[dict[str, str]] | None]] = {
    "user": ([USER], False, None),
    "system and user": ([SYSTEM, USER], False, None),
    "multi-turn": (
        [
            SYSTEM,
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
        False,
        None,
    ),
    "reasoning in an earlier turn": (
        [
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        False,
        None,
    ),
    "two user turns in a row": ([USER, {"role": "user", "content": "Please."}], False, None),
    "tool call and result": (
        [
            SYSTEM,
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": '{"temp_c": 21}'},
        ],
        True,
        None,
    ),
    "tool round trip then a new question": (
        [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21 °C, sunny"},
            {"role": "assistant", "content": "It is 21 °C and sunny."},
            {"role": "user", "content": "Thanks. Tomorrow?"},
        ],
        True,
        None,
    ),
    "tools offered, none called": ([SYSTEM, USER], True, None),
    "documents": (
        [USER],
        True,  # Command R7B's tool_use template reads both
        [{"title": "Forecast", "text": "Zürich: 21 °C, sunny."}, {"title": "Note", "text": "<none>"}],
    ),
}

# The conversations a template refuses (its raise_exception, or a field it needs): transformers
# refuses them too, and the test checks that it does, with the same message.
NO_SYSTEM_ROLE = ("system and user", "multi-turn", "tool call and result", "tools offered, none called")
REFUSED = {
    *(("google-gemma-2-2b-it", conversation) for conversation in NO_SYSTEM_ROLE),
    # Roles must alternate.
    ("google-gemma-2-2b-it", "tool round trip then a new question"),
    ("google-gemma-2-2b-it", "two user turns in a row"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "two user turns in a row"),
    # An assistant turn with no content (its None dropped, as apply_chat_template drops it).
    *(
        (name, "tool call and result")
        for name in (
            "HuggingFaceTB-SmolLM2-135M-Instruct",
            "Qwen-Qwen3-0.6B",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            "deepseek-ai-DeepSeek-V3.1",
            "microsoft-Phi-3.5-mini-instruct",
        )
    ),
    # DeepSeek-V3.1's adds a call's arguments to text, which an object (as transformers passes it) is not;
    # the server passes one that is (tool_calls.ArgumentsObject).
    ("deepseek-ai-DeepSeek-V3.1", "tool round trip then a new question"),
}


def _tokenizer(source: str | dict[str, str], special_tokens: dict[str, str], **extra: Any) -> Any:
    """A tokenizer with this template and these tokens and no vocabulary to speak of: rendering needs none."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast  # the test may import transformers; the frontend may not

    vocabulary = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(
        tokenizer_object=vocabulary, chat_template=source, **special_tokens, **extra
    )


@pytest.fixture(scope="module", params=sorted(SPECIAL_TOKENS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(name, transformers' tokenizer, our template read from the directory the tokenizer was saved to)."""
    name = request.param
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    tokenizer = _tokenizer(source, SPECIAL_TOKENS[name])
    directory = tmp_path_factory.mktemp(name)
    tokenizer.save_pretrained(directory)
    yield name, tokenizer, load_chat_template(str(directory))


def test_every_family_has_its_template_and_tokens() -> None:
    names = {path.stem for path in TEMPLATES.glob("*.jinja")}
    assert names == set(SPECIAL_TOKENS)
    assert len(names) >= 8


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_rendered_as_transformers_renders(
    family: tuple, conversation: str, add_generation_prompt: bool
) -> None:
    name, tokenizer, ours = family
    messages, with_tools, documents = CONVERSATIONS[conversation]
    assert not isinstance(ours, UnusableChatTemplate), ours.problem
    # As the server does: tools go to the template only when it takes them.
    tools = [WEATHER_TOOL] if with_tools and ours.takes_tools else None
    arguments = dict(tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
    try:
        expected = tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **arguments)
    except Exception as refusal:
        assert (name, conversation) in REFUSED, f"transformers refused: {refusal}"
        with pytest.raises(ChatTemplateError) as ours_refused:
            ours.render(copy.deepcopy(messages), **arguments)
        assert str(ours_refused.value) == str(refusal)
        return
    assert (name, conversation) not in REFUSED, "transformers rendered a conversation expected to be refused"
    assert ours.render(copy.deepcopy(messages), **arguments) == expected


def test_special_tokens_are_those_transformers_passes(tmp_path: Path) -> None:
    """Besides bos/eos/..., a model's own named tokens (`image_token`) reach the template too."""
    from transformers import AutoTokenizer

    source = (
        "{{ bos_token }}{{ image_token }}{{ mask_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    special = {"bos_token": "<s>", "mask_token": "<mask>"}
    _tokenizer(source, special, extra_special_tokens={"image_token": "<image>"}).save_pretrained(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    ours = load_chat_template(str(tmp_path))
    assert ours.special_tokens == reference.special_tokens_map
    messages = [{"role": "user", "content": "hi"}]
    assert ours.render(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_tool_use_template_is_taken_for_requests_with_tools(tmp_path: Path) -> None:
    templates = {
        "default": "plain:{% for m in messages %}{{ m.content }}{% endfor %}",
        "tool_use": "tools {{ tools | tojson }}:{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    tokenizer = _tokenizer(templates, {"eos_token": "</s>"})
    tokenizer.save_pretrained(tmp_path)
    ours = load_chat_template(str(tmp_path))
    assert ours.takes_tools
    for tools in (None, [WEATHER_TOOL]):
        expected = tokenizer.apply_chat_template(
            [USER], tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours.render([USER], tools=tools) == expected


BROKEN_TEMPLATE = "{% for message in messages %}{{ message['content'] }\n{% endfor %}"


def test_a_template_that_does_not_compile_is_logged_and_refuses_chats(tmp_path: Path, caplog) -> None:
    (tmp_path / "chat_template.jinja").write_text(BROKEN_TEMPLATE, encoding="utf-8")
    with caplog.at_level(logging.ERROR, logger="inference_api.chat_template"):
        template = load_chat_template(str(tmp_path))
    assert isinstance(template, ChatTemplate) and not template.takes_tools
    assert "chat template cannot be used" in caplog.text and "line 1" in caplog.text
    with pytest.raises(ChatTemplateError, match="the model has no usable chat template: .*line 1"):
        template.render([USER])


# --- End to end: a model whose template is broken still serves completions ---------------------------


@pytest.fixture(scope="module")
def broken_template_server(
    tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path
) -> Iterator[RunningServer]:
    """A tiny random Llama, the default model's tokenizer, and a chat_template.jinja that does not compile."""
    from transformers import AutoTokenizer

    from tests.backend.models import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_dir)
    directory = tmp_path_factory.mktemp("broken-template")
    tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(
        directory
    )
    tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(BROKEN_TEMPLATE, encoding="utf-8")
    with running_server(
        "--model", str(directory), "--rows", "2", "--max-seq-len", "128", ready_timeout=300
    ) as server:
        yield server


def test_a_broken_template_refuses_chats_and_serves_completions(
    broken_template_server: RunningServer,
) -> None:
    url = broken_template_server.url
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    chat = {"model": model, "messages": [USER], "max_tokens": 3}
    refused = requests.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"].startswith("the model has no usable chat template: ")
    anthropic = {"model": model, "messages": [USER], "max_tokens": 3}
    assert requests.post(f"{url}/v1/messages", json=anthropic, timeout=60).status_code == 400
    completion = {"model": model, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    served = requests.post(f"{url}/v1/completions", json=completion, timeout=60)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 3
    assert "chat template cannot be used" in broken_template_server.log()
