"""REAL MODEL: speculative decoding with a draft model as a client meets it. The default model served in
the exact mode (float32) takes its own 4-bit GGUF file as `--draft-model` (loaded in the default mode,
as every draft model is): free writing, which prompt lookup rarely guesses, comes out the same with
drafts and without (`speculative: false`), and /metrics counts the draft tokens that stood."""

from __future__ import annotations

import pytest

from backend.model.source import default_model_path
from tests.frontend.test_speculative_e2e import with_drafts_and_without
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
    plain, streamed, drafted, accepted = with_drafts_and_without(drafted_server, STORY, 80)
    assert streamed == plain and len(streamed) > 200
    # the 4-bit copy guesses the float32 model's free text: most of its guesses stand
    assert accepted > 30 and accepted / drafted > 0.6
