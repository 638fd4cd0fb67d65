"""How many streams a request takes: what a team's `concurrent_streams` limit counts.

One request to /v1/completions with a list of prompts and `n` choices runs in the inference server as
prompts x n requests, each in a row of its own (inference_api/choices.py): counted as one, a request of
6 prompts and n 16 took all 32 rows and the whole queue of a server while its team's limit was 2. The two
OpenAI endpoints that fan out are read for their prompts and `n` (under /v1/ and again under
/v1/openai/v1/, where Llama Stack's client calls them); every other request is one stream.
A body that is not what the server takes counts one: the server answers it with a 400 at once.
"""

from __future__ import annotations

import json
from typing import Any

COMPLETIONS_PATHS = frozenset({"/v1/completions", "/v1/openai/v1/completions"})
FAN_OUT_PATHS = COMPLETIONS_PATHS | {"/v1/chat/completions", "/v1/openai/v1/chat/completions"}


def streams_of(path: str, body: bytes) -> int:
    """The rows this request asks the inference server for: prompts x n, or 1."""
    if path not in FAN_OUT_PATHS:
        return 1
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; too deep, a RecursionError
        return 1
    if not isinstance(data, dict):
        return 1
    prompts = prompt_count(data.get("prompt")) if path in COMPLETIONS_PATHS else 1
    return prompts * positive_integer(data.get("n"))


def prompt_count(prompt: Any) -> int:
    """A prompt field as the server reads it: a string or a list of token ids is one prompt, a list of
    strings or of token-id lists is one each."""
    if isinstance(prompt, list) and prompt and not all(isinstance(item, int) for item in prompt):
        return len(prompt)
    return 1


def positive_integer(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1
