"""Plain HTTP clients on the OpenAI API: requests reading SSE line by line, curl -N, and README's examples."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import requests

from tests.conftest import ROOT
from tests.openai.conftest import MODEL


def test_requests_reads_server_sent_events_line_by_line(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "stream": True,
        "max_tokens": 20,
        "temperature": 0,
    }
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    text = "".join(event["choices"][0]["delta"].get("content", "") for event in events)
    whole = requests.post(
        f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=60
    ).json()
    assert text == whole["choices"][0]["message"]["content"]


def test_curl_streams_the_events(server):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True})
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            f"{server.url}/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    events = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def readme_block(language: str, marker: str) -> str:
    """The README's code block of that language that contains the marker."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", readme, flags=re.S) if marker in b]
    assert len(blocks) == 1, f"README has {len(blocks)} {language} blocks with {marker!r}"
    return blocks[0].replace("http://127.0.0.1:8000", server_url_placeholder)


server_url_placeholder = "SERVER_URL"


def test_the_readme_curl_example_works_as_written(server):
    command = readme_block("sh", "/v1/chat/completions").replace(server_url_placeholder, server.url)
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["choices"][0]["message"]["content"]


def test_the_readme_openai_example_works_as_written(server):
    code = readme_block("python", "import openai").replace(server_url_placeholder, server.url)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) > 10
