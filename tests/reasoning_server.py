"""A server that reads a reasoning model's thoughts (inference_api/reasoning.py), for the tests of the APIs
and of the chat page that show them: the default model in the exact mode, with `--reasoning-parser qwen3`
and Qwen3's real chat template edited as Qwen3's Thinking-2507 and DeepSeek-R1-0528 templates are, so
that with thinking on the prompt opens the `<think>` block and the answer starts with thoughts.

SmolLM2 does not think by itself: its greedy text after an opened block is all thoughts (it never
closes the block in a few tokens), and a `guided_regex` writes thoughts that end where a test needs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import ROOT
from tests.server_fixture import RunningServer, running_server

TEMPLATES = ROOT / "tests" / "frontend" / "chat_templates"
# Qwen3's generation prompt closes an empty block with thinking off; with it on, the thinking models'
# templates open one.
QWEN3_PROMPT_END = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""
OPENING_PROMPT_END = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}"""


def thinking_template(directory: Path) -> Path:
    """Qwen3's template, edited to open the thoughts' block when thinking is on, as a file here."""
    source = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert QWEN3_PROMPT_END in source
    template = directory / "qwen3-thinking.jinja"
    template.write_text(source.replace(QWEN3_PROMPT_END, OPENING_PROMPT_END))
    return template


@contextmanager
def reasoning_server(directory: Path) -> Iterator[RunningServer]:
    """The server, its template written into `directory`."""
    options = ["--chat-template", str(thinking_template(directory)), "--reasoning-parser", "qwen3"]
    exact = ["--dtype", "float32", "--quantize", "none", "--rows", "4", "--max-seq-len", "1024"]
    with running_server(*options, *exact, ready_timeout=300) as server:
        yield server
