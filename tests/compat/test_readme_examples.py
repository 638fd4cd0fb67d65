"""README's curl examples of the Messages, Responses, Llama Stack, TGI and embeddings APIs, run as written
through the proxy on the real default model, with a token in TOKEN; and every one of its curl examples
against the mock served under the default model's name (`--served-model-name`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT
from tests.openai.conftest import MODEL
from tests.proxy.conftest import running_proxy, token
from tests.server_fixture import RunningServer, running_server


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
        ("/generate", lambda output: json.loads(output)["generated_text"]),
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


def readme_curl_commands() -> list[str]:
    """Every curl command README gives to paste: its sh blocks, and its indented ones with their
    continuation lines (but the `make run` sample, whose token is elided)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.S)
    commands = [block.strip() for block in blocks if block.lstrip().startswith("curl ")]
    indented = re.findall(r"^    (curl (?:.*\\\n)*.*)$", readme, flags=re.M)
    return commands + [command for command in indented if "..." not in command]


@pytest.fixture(scope="module")
def mock_as_the_default_model() -> Iterator[tuple[RunningServer, RunningServer]]:
    """The mock served as SmolLM2-135M-Instruct (`--served-model-name`), and the proxy in front."""
    options = ("--mock", "--rows", "2", "--mock-tokens-per-second", "1000", "--served-model-name", MODEL)
    with running_server(*options) as server, running_proxy(server.url) as proxy:
        yield server, proxy


@pytest.mark.parametrize(
    "command", readme_curl_commands(), ids=lambda command: re.search(r":80[08]0(/\S*)", command)[1]
)
def test_every_readme_curl_example_works_against_the_mock_as_written(mock_as_the_default_model, command):
    server, proxy = mock_as_the_default_model
    command = command.replace("http://127.0.0.1:8080", proxy.url).replace("http://127.0.0.1:8000", server.url)
    result = subprocess.run(
        ["bash", "-c", command + " -sS -w '\\n%{http_code}'"],
        env={**os.environ, "TOKEN": token()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    body, status = result.stdout.rsplit("\n", 1)
    assert result.returncode == 0 and status == "200", result.stdout + result.stderr
    assert body.strip()


def test_readme_has_a_curl_example_of_each_api():
    paths = {re.search(r":80[08]0(/\S*)", command)[1] for command in readme_curl_commands()}
    assert {
        "/predictions/SmolLM2-135M-Instruct",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/inference/chat_completion",
        "/v1/embeddings",
        "/generate",
    } <= paths
