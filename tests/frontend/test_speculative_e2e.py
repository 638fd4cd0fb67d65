"""REAL MODEL: speculative decoding (prompt lookup) as a client meets it, on the default model in the
default mode, where it is on: an edit's answer, which repeats its prompt, comes out the same with it and
without it (`speculative: false`), and /metrics counts the draft tokens that stood."""

from __future__ import annotations

import re
from difflib import SequenceMatcher
from pathlib import Path

import openai
import pytest
import requests

from tests.server_fixture import RunningServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
FILE = (Path(__file__).resolve().parents[2] / "backend" / "engine" / "prompt_lookup.py").read_text()
EDIT = [
    {
        "role": "user",
        # The file fenced, and the answer asked for in a fence: asked plainly, the model explained the
        # class instead on one CPU (an Intel Xeon) where its bfloat16 sums round otherwise than on the AMD
        # EPYC it copied on; fenced, it copies on both.
        "content": "Rewrite this Python file with the class PromptLookup renamed to NgramLookup. Output the "
        "whole file in one ```python block and nothing else.\n\n```python\n" + FILE + "```",
    }
]


def counter(server: RunningServer, name: str) -> float:
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(rf"^{name}_total (\S+)$", metrics, re.MULTILINE).group(1))


def drafts(server: RunningServer) -> tuple[float, float]:
    return (
        counter(server, "inference_spec_decode_draft_tokens"),
        counter(server, "inference_spec_decode_accepted_tokens"),
    )


def with_drafts_and_without(server: RunningServer, messages: list[dict], max_tokens: int) -> tuple:
    """A greedy chat request without drafts (`speculative: false`, which drafts nothing), then streamed
    with them, through the official client: the two texts and the draft tokens checked and stood."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=300)
    ask = dict(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    # Both requests below then find the prompt cached, whatever ran on this server before: a prompt
    # prefilled whole and one found cached round a near tie differently in the default mode's bfloat16.
    client.chat.completions.create(**{**ask, "max_tokens": 1})
    before = drafts(server)
    plain = client.chat.completions.create(**ask, extra_body={"speculative": False})
    assert drafts(server) == before  # a request may turn it off
    chunks = client.chat.completions.create(**ask, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    drafted, accepted = (after - earlier for after, earlier in zip(drafts(server), before, strict=True))
    return plain.choices[0].message.content, streamed, drafted, accepted


def longest_run_in_common(text: str, source: str) -> int:
    """The length of the longest stretch of `text` found as it is in `source`. Not the rename itself:
    greedy at bfloat16, the model renamed the class on one CPU and copied the file as it was on another,
    and either way its answer repeats the prompt, which is what gives the drafts their chance."""
    matcher = SequenceMatcher(None, text, source, autojunk=False)
    return matcher.find_longest_match(0, len(text), 0, len(source)).size


def test_an_edit_is_the_same_with_drafts_and_without_and_most_drafts_stand(default_mode_server) -> None:
    plain, streamed, drafted, accepted = with_drafts_and_without(default_mode_server, EDIT, 120)
    assert streamed == plain
    assert longest_run_in_common(streamed, FILE) >= 200  # an edit's text repeats its prompt's
    assert accepted > 40 and accepted / drafted > 0.5


def test_speculative_must_be_a_boolean(default_mode_server) -> None:
    response = requests.post(
        f"{default_mode_server.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "speculative": "sometimes"},
        timeout=60,
    )
    assert response.status_code == 400 and "speculative" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "speculative"
