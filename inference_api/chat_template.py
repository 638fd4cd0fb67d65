"""The model's chat template, rendered without torch: messages to the prompt text.

`/v1/chat/completions` must get exactly the text that
`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`
gives, from the files the backend saved (chat_template.jinja,
additional_chat_templates/, or the chat_template field of
tokenizer_config.json). The Jinja environment mirrors transformers' own
(`_compile_jinja_template` in transformers/utils/chat_template_utils.py): the
sandbox, `loopcontrols`, the `{% generation %}` block, its `tojson`,
`raise_exception`, `strftime_now`, `dict` and `namespace`, and the same render
arguments. It is mirrored rather than imported: importing that module costs
every gunicorn worker about 0.6 s and 50 MB (numpy, PIL and transformers'
utilities) for a few small functions, and nothing promises it stays free of
torch. tests/frontend/test_chat_templates_like_transformers.py holds the two
to the same text on the real templates of a dozen model families.

A template that does not compile does not stop the server: it is logged, chat
requests get a 400 saying the model has no usable chat template, and
completions are served as usual.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any

import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

# For a model without a template (and for the mock): plain "role: content" lines.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# The tokens transformers passes to every template (SPECIAL_TOKENS_ATTRIBUTES), when the tokenizer has them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# What the server passes every template itself: a request's `chat_template_kwargs` may not set these.
SERVER_SET_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", *SPECIAL_TOKEN_NAMES)

# Names a message's reasoning comes under; templates read `reasoning_content`, gpt-oss's reads `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (for example, roles out of the order it expects)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks.

    transformers' AssistantTracker renders the body unchanged when it is not
    tracking token indices, which is always the case for a prompt.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` without the type itself, so a template cannot reach Python's internals through it."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, as transformers' does (a sandbox escape otherwise)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' environment; a syntax error raises jinja2's TemplateSyntaxError."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(source)


def _as_template_sees(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: what apply_chat_template does before rendering."""
    # Keys whose value is None are dropped: templates test for a missing key, not for None.
    plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
    return [_with_reasoning_aliases(message) for message in plain]


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A model's compiled template and the special tokens it is rendered with."""

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str] | None = None,
        tool_use_source: str | None = None,
    ):
        self.source = source
        self.special_tokens = special_tokens or {}
        self.template = compile_template(source)
        # A model may name a second template for requests with tools (transformers picks "tool_use" then).
        self.tool_use_template = compile_template(tool_use_source) if tool_use_source else None

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders a `tools` argument (else tool_calls.py describes them itself)."""
        return self.tool_use_template is not None or "tools" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the prompt's text; `extra`: the request's own variables for the template
        (vLLM's `chat_template_kwargs`, such as Qwen3's `enable_thinking`), none of SERVER_SET_VARIABLES."""
        template = self.template
        if tools is not None and self.tool_use_template is not None:
            template = self.tool_use_template
        try:
            return template.render(
                **(extra or {}),
                messages=_as_template_sees(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as error:
            # The template is the model's code run on the client's messages: whatever it raises
            # (raise_exception, None + str, ...) is its refusal of them, not a fault of the server.
            raise ChatTemplateError(str(error) or type(error).__name__) from None


class UnusableChatTemplate(ChatTemplate):
    """The model's template does not compile: chat requests are refused, the rest is served."""

    def __init__(self, problem: str):
        self.source = ""
        self.special_tokens = {}
        self.template = None
        self.tool_use_template = None
        self.problem = problem

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        raise ChatTemplateError(f"the model has no usable chat template: {self.problem}")


def load_chat_template(directory: str | None, chosen: str | None = None) -> ChatTemplate:
    """The template saved beside the tokenizer, else the plain fallback; never raises for a bad template.
    `chosen`: a template file the operator gives instead (--chat-template), rendered with the tokenizer's
    special tokens; TemplateError if it does not compile."""
    config = {} if directory is None else _read_json(os.path.join(directory, "tokenizer_config.json"))
    special_tokens = special_tokens_of(config)
    if chosen is not None:
        return ChatTemplate(_read_text(chosen), special_tokens)
    if directory is None:
        return ChatTemplate(FALLBACK_TEMPLATE)
    templates = _saved_templates(directory, config)
    if not templates:
        return ChatTemplate(FALLBACK_TEMPLATE, special_tokens)
    if "default" not in templates:
        return _unusable(f"several named chat templates ({', '.join(sorted(templates))}) and no default")
    try:
        return ChatTemplate(templates["default"], special_tokens, templates.get("tool_use"))
    except TemplateError as error:
        return _unusable(_describe(error))


def _unusable(problem: str) -> UnusableChatTemplate:
    log.error(
        "the model's chat template cannot be used (%s): chat requests will get a 400, completions are served",
        problem,
    )
    return UnusableChatTemplate(problem)


def _describe(error: TemplateError) -> str:
    line = getattr(error, "lineno", None)
    return f"{type(error).__name__} at line {line}: {error.message}" if line else str(error)


def _saved_templates(directory: str, config: dict[str, Any]) -> dict[str, str]:
    """Templates by name, as transformers reads them: files win over tokenizer_config.json's field."""
    templates = {}
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        templates["default"] = _read_text(jinja_path)
    extra = os.path.join(directory, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                templates[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
    if templates:
        return templates
    source = config.get("chat_template")
    if isinstance(source, list):
        return {entry["name"]: entry["template"] for entry in source}
    return {"default": source} if source else {}


def special_tokens_of(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens a tokenizer_config.json gives (transformers' `special_tokens_map`).

    Besides the standard ones, transformers passes a model's own named tokens
    (`image_token`, ...): other `*_token` string fields and the dict forms of
    `extra_special_tokens` and `model_specific_special_tokens`.
    """
    tokens = {name: config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    for name, value in config.items():
        if name.endswith("_token") and name not in tokens and _is_token(value):
            tokens[name] = value
    for field in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(field), dict):
            tokens.update(config[field])
    return {name: _token_text(value) for name, value in tokens.items()}


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def _is_token(value: Any) -> bool:
    """A string, or an AddedToken as tokenizer_config.json stores one."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _token_text(token: Any) -> str:
    return token["content"] if isinstance(token, dict) else str(token)
