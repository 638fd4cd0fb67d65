"""Requests that can never succeed, through the real gunicorn server on the default model: each is a 400 in
OpenAI's error shape whose `param` names the field at fault, never a 503 with Retry-After (which clients
retry for ever) nor a 200 whose text does not follow what was asked (SPEC §4: bad input gets a 4xx).

Marked `real_model`: it loads the default model (a minute or so on a 2-core CPU).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests

from tests.server_fixture import RunningServer, running_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
ROWS, MAX_QUEUE, CONTEXT = 4, 8, 1024


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    options = f"--rows {ROWS} --max-queue {MAX_QUEUE} --max-seq-len {CONTEXT}"
    with running_server(*options.split(), ready_timeout=600) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client(timeout=300)


def post(server: RunningServer, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=300)


def assert_refused(response: requests.Response, param: str, *saying: str) -> dict:
    """A 400 in OpenAI's shape naming `param`, with no Retry-After; its error object."""
    assert response.status_code == 400, response.text
    assert "Retry-After" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for words in saying:
        assert words in error["message"], error
    return error


# More generations at once than the rows and the queue hold together.


def test_more_choices_than_rows_and_queue_on_an_idle_server_is_a_400_naming_n(server):
    prompts = ["One", "Two", "Three", "Four", "Five", "Six"]
    response = post(server, "/v1/completions", {"prompt": prompts, "n": 16, "max_tokens": 2})
    assert_refused(response, "n", "96", str(ROWS + MAX_QUEUE))


def test_as_many_choices_as_rows_and_queue_hold_are_served(server):
    response = post(server, "/v1/completions", {"prompt": ["One", "Two", "Three"], "n": 4, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == ROWS + MAX_QUEUE


def test_more_prompts_than_rows_and_queue_is_a_400_naming_the_prompt(server):
    prompts = [f"Prompt {i}" for i in range(ROWS + MAX_QUEUE + 1)]
    response = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 2})
    assert_refused(response, "prompt", str(ROWS + MAX_QUEUE + 1))


def test_more_embedding_inputs_than_rows_and_queue_is_a_400_naming_input(server):
    response = post(server, "/v1/embeddings", {"input": [f"text {i}" for i in range(ROWS + MAX_QUEUE + 1)]})
    assert_refused(response, "input")


# Scoring a prompt that fills the context.


def score(server: RunningServer, tokens: int) -> requests.Response:
    body = {"prompt": [1] * tokens, "max_tokens": 0, "echo": True, "logprobs": 1}
    return post(server, "/v1/completions", body)


def test_scoring_a_prompt_as_long_as_the_context_is_a_400_naming_the_prompt(server):
    error = assert_refused(score(server, CONTEXT), "prompt", str(CONTEXT))
    assert error["code"] == "context_length_exceeded"


def test_scoring_a_prompt_one_shorter_than_the_context_is_served(server):
    response = score(server, CONTEXT - 1)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["tokens"]) == CONTEXT - 1


# A long guided_choice.


def test_a_guided_choice_of_2500_choices_answers_one_of_them(client):
    choices = [f"item number {i}" for i in range(2500)]
    completion = client.completions.create(
        model=MODEL,
        prompt="Pick an item: ",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_choice": choices},
    )
    assert completion.choices[0].text in choices
    assert completion.choices[0].finish_reason == "stop"


# Constraints no text can meet.

NOTHING_MEETS = [
    pytest.param("guided_regex", "[^\\s\\S]", id="regex-of-no-character"),
    pytest.param("guided_grammar", "start: a\na: a", id="grammar-that-never-ends"),
]


@pytest.mark.parametrize("field, constraint", NOTHING_MEETS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_no_text_can_meet_is_a_400_naming_its_field(server, field, constraint, stream):
    body = {"prompt": "Hello", "max_tokens": 8, field: constraint, "stream": stream}
    assert_refused(post(server, "/v1/completions", body), field, "grammar")


def test_a_chat_with_a_constraint_no_text_can_meet_is_a_400_naming_its_field(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "guided_regex": "[^\\s\\S]"}
    assert_refused(post(server, "/v1/chat/completions", body), "guided_regex")


# A grammar that lets the text start but has no way to end: it allows "ab", then nothing.
DEAD_END = 'start: "ab" b\nb: b'


def test_a_grammar_with_no_way_on_is_a_400_never_a_stop(server):
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "guided_grammar": DEAD_END}
    assert_refused(post(server, "/v1/completions", body), "guided_grammar", "grammar")


def test_a_streamed_grammar_with_no_way_on_ends_with_an_error_event(client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"guided_grammar": DEAD_END},
    )
    texts = []
    with pytest.raises(openai.APIError, match="grammar"):  # the client raises the error event
        for chunk in stream:
            texts.append(chunk.choices[0].text)
            assert chunk.choices[0].finish_reason is None, "a dead end must not end as a stop"
    assert "".join(texts) == "ab"


def test_the_server_serves_normally_afterwards(client):
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.choices[0].text
