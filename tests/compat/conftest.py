"""The APIs beside OpenAI's chat and completions (Anthropic's Messages, OpenAI's Responses, Llama Stack's
inference): the OpenAI tests' real server on the default model (one for both packages) and a proxy in front
of it, a mock server for the mechanics (validation, error shapes, cancellation), and the model's own
tokenizer to count with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.openai.conftest import MODEL, server, tokenizer
from tests.proxy.conftest import RunningProxy, running_proxy
from tests.server_fixture import RunningServer, running_server

__all__ = ["MODEL", "server", "tokenizer", "template_tokens"]


@pytest.fixture(scope="package")
def proxy(server: RunningServer) -> Iterator[RunningProxy]:
    with running_proxy(server.url) as running:
        yield running


@pytest.fixture(scope="package")
def mock_server() -> Iterator[RunningServer]:
    """200 tokens a second: an answer that ran to a long max_tokens would take seconds."""
    with running_server("--mock", "--rows", "2", "--mock-tokens-per-second", "200") as running:
        yield running


def template_tokens(tokenizer, messages: list[dict[str, str]], continuation: str = "") -> int:
    """How many tokens the conversation is through the chat template, as transformers renders it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text + continuation, add_special_tokens=False).input_ids)
