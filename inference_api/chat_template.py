"""The model's chat template, rendered without torch: messages to the prompt text.

transformers renders chat templates with Jinja2 in a sandbox; this does the
same from the files the backend saved (chat_template.jinja, or the
chat_template field of tokenizer_config.json), so that `/v1/chat/completions`
gets the text `tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` would give.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For a model without a template (and for the mock): plain "role: content" lines.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (for example, roles out of the order it expects)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        self.template = environment.from_string(source)
        self.source = source
        self.special_tokens = special_tokens or {}

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders a `tools` argument (else tool_calls.py describes them itself)."""
        return "tools" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **self.special_tokens,
            )
        except TemplateError as error:
            raise ChatTemplateError(str(error)) from None


def load_chat_template(directory: str | None) -> ChatTemplate:
    """The template saved beside the tokenizer, else the plain fallback."""
    if directory is None:
        return ChatTemplate(FALLBACK_TEMPLATE)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    special_tokens = {
        name: _token_text(config.get(name))
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if config.get(name) is not None
    }
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as file:
            return ChatTemplate(file.read(), special_tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: take the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    return ChatTemplate(source or FALLBACK_TEMPLATE, special_tokens)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _token_text(token: Any) -> str:
    return token["content"] if isinstance(token, dict) else str(token)
