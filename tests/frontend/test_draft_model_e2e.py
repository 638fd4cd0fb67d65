"""REAL MODEL: speculative decoding with a draft model as a client meets it. The default model served in
the exact mode (float32) takes its own 4-bit GGUF file as `--draft-model` (loaded in the default mode,
as every draft model is): free writing, which prompt lookup rarely guesses, comes out the same with
drafts and without (`speculative: false`), and /metrics counts the draft tokens that stood."""

from __future__ import annotations

import openai
import pytest

from backend.model.loader import default_model_path
from tests.frontend.test_speculative_e2e import MODEL, drafts
from tests.server_fixture import running_server

pytestmark = pytest.mark.real_model

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a map."}]


@pytest.fixture(scope="module")
def drafted_server():
    options = "--dtype float32 --quantize none --rows 2 --max-seq-len 512"
    with running_server(
        *options.split(), "--draft-model", str(default_model_path()), ready_timeout=300
    ) as server:
        yield server


def test_free_writing_is_the_same_with_a_draft_models_guesses_and_without(drafted_server) -> None:
    client = openai.OpenAI(base_url=f"{drafted_server.url}/v1", api_key="-", max_retries=0, timeout=300)
    ask = dict(model=MODEL, messages=STORY, temperature=0, max_tokens=80)
    before = drafts(drafted_server)
    plain = client.chat.completions.create(**ask, extra_body={"speculative": False})
    assert drafts(drafted_server) == before  # a request may turn it off
    chunks = client.chat.completions.create(**ask, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    drafted, accepted = (
        after - earlier for after, earlier in zip(drafts(drafted_server), before, strict=True)
    )
    assert streamed == plain.choices[0].message.content and len(streamed) > 200
    # the 4-bit copy guesses the float32 model's free text: most of its guesses stand
    assert accepted > 30 and accepted / drafted > 0.6
