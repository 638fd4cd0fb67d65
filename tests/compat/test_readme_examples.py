"""README's curl examples of the Messages, Responses, Llama Stack and embeddings APIs, run as written
through the proxy on the real default model, with a token in TOKEN."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import ROOT
from tests.proxy.conftest import token


def readme_curl(marker: str) -> str:
    """The README's one sh block that contains the marker."""
    readme = (ROOT / "README.md").read_text()
    blocks = [block for block in re.findall(r"```sh\n(.*?)```", readme, flags=re.S) if marker in block]
    assert len(blocks) == 1, f"README has {len(blocks)} sh blocks with {marker!r}"
    return blocks[0]


def message_text(output: str) -> str:
    return json.loads(output)["content"][0]["text"]


def response_text(output: str) -> str:
    return json.loads(output)["output"][0]["content"][0]["text"]


def chat_events_text(output: str) -> str:
    events = [json.loads(line.removeprefix("data: ")) for line in output.splitlines() if line]
    assert [event["event"]["event_type"] for event in events[:: len(events) - 1]] == ["start", "complete"]
    return "".join(event["event"]["delta"]["text"] for event in events)


def embeddings_text(output: str) -> str:
    """The two vectors' lengths, if each is a unit vector (a text, as the other examples give)."""
    vectors = [item["embedding"] for item in json.loads(output)["data"]]
    assert len(vectors) == 2 and all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    return " ".join(str(len(v)) for v in vectors)


@pytest.mark.parametrize(
    "marker, text_of",
    [
        ("/v1/messages", message_text),
        ("/v1/responses", response_text),
        ("/inference/chat_completion", chat_events_text),
        ("/v1/embeddings", embeddings_text),
    ],
)
def test_the_readme_example_works_through_the_proxy_as_written(proxy, marker, text_of):
    command = readme_curl(marker).replace("http://127.0.0.1:8080", proxy.url)
    result = subprocess.run(
        ["bash", "-c", command],
        env={**os.environ, "TOKEN": token()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert text_of(result.stdout).strip(), result.stdout  # sampled: any answer, but one
