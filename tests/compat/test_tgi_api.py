"""Text Generation Inference's API (inference_api/apis/tgi) through its most used client, huggingface_hub's
InferenceClient (what LangChain's HuggingFaceEndpoint calls), on the default model in the exact mode;
raw HTTP where the client hides the shape, each answer checked against the OpenAPI document.

The answers are held to the OpenAI API's on the same prompt: TGI's greedy text and its tokens' logprobs
are the completions endpoint's, so that the new API adds a shape and nothing else.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

from tests.compat.conftest import MODEL
from tests.frontend.test_openapi_e2e import documented
from tests.server_fixture import RunningServer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: RunningServer) -> InferenceClient:
    return InferenceClient(model=server.url, timeout=120)


def completion(server: RunningServer, **fields) -> dict:
    """The OpenAI completions endpoint's greedy answer to PROMPT, with each token's logprob."""
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "logprobs": 0, **fields}
    return requests.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]


def test_the_greedy_answer_and_its_details_are_the_completions_endpoints(client, server, tokenizer):
    output = client.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True)
    reference = completion(server, max_tokens=8)
    assert output.generated_text == reference["text"]
    details = output.details
    assert (details.finish_reason, details.generated_tokens) == ("length", 8)
    # To float32's rounding: scoring the input too computes its positions' logits in another shape.
    logprobs = reference["logprobs"]["token_logprobs"]
    assert [token.logprob for token in details.tokens] == pytest.approx(logprobs, abs=1e-4)
    assert "".join(token.text for token in details.tokens) == output.generated_text
    assert tokenizer.decode([token.id for token in details.tokens]) == output.generated_text
    # The input's tokens: the first has no logprob, nothing predicts it.
    assert [token.id for token in details.prefill] == tokenizer.encode(PROMPT)
    assert details.prefill[0].logprob is None and all(token.logprob < 0 for token in details.prefill[1:])
    assert client.text_generation(PROMPT, max_new_tokens=8) == output.generated_text


def test_the_stream_is_a_token_an_event_and_ends_with_the_whole_text(client):
    whole = client.text_generation(PROMPT, max_new_tokens=12, details=True)
    events = list(client.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    assert [event.index for event in events] == list(range(1, 13))
    assert [event.token.id for event in events] == [token.id for token in whole.details.tokens]
    assert events[-1].generated_text == "".join(event.token.text for event in events) == whole.generated_text
    assert all(event.generated_text is None and event.details is None for event in events[:-1])
    assert (events[-1].details.finish_reason, events[-1].details.generated_tokens) == ("length", 12)
    assert "".join(client.text_generation(PROMPT, max_new_tokens=12, stream=True)) == whole.generated_text


def test_why_the_answer_ended(client, server):
    stopped = client.text_generation(PROMPT, max_new_tokens=20, stop=["."], details=True)
    assert stopped.details.finish_reason == "stop_sequence" and "." not in stopped.generated_text
    # SmolLM2 ends a chat turn with <|im_end|>, its end token: special, with no text.
    turn = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    ended = client.text_generation(turn, max_new_tokens=60, details=True)
    assert ended.details.finish_reason == "eos_token"
    last = ended.details.tokens[-1]
    assert (last.special, last.text) == (True, "")


def test_sampling_top_tokens_full_text_truncation_and_a_grammar(client, tokenizer):
    sampled = [client.text_generation(PROMPT, max_new_tokens=10, do_sample=True, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed draws the same
    assert client.text_generation(PROMPT, max_new_tokens=10, do_sample=True, seed=8) != sampled[0]
    alternatives = client.text_generation(PROMPT, max_new_tokens=3, top_n_tokens=3, details=True)
    for token, top in zip(alternatives.details.tokens, alternatives.details.top_tokens, strict=True):
        assert len(top) == 3 and top[0]["id"] == token.id  # greedy: the most likely is the one taken
    full = client.text_generation(PROMPT, max_new_tokens=3, return_full_text=True)
    assert full == PROMPT + client.text_generation(PROMPT, max_new_tokens=3)
    truncated = client.text_generation(
        PROMPT, max_new_tokens=1, truncate=2, decoder_input_details=True, details=True
    )
    assert [token.id for token in truncated.details.prefill] == tokenizer.encode(PROMPT)[-2:]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    answer = client.text_generation(PROMPT, max_new_tokens=30, grammar={"type": "json", "value": schema})
    assert isinstance(json.loads(answer)["city"], str)


def test_typical_p_cuts_as_asked_and_langchains_defaults_sample_reproducibly(client):
    """typical_p 0.001 keeps one token a step (the one nearest the entropy): every seed gives one text,
    where without it two seeds differ. LangChain's HuggingFaceEndpoint sends typical_p 0.95 unless told
    (its defaults below): a sampled answer, the same again with the same seed."""
    typical = {
        client.text_generation(PROMPT, max_new_tokens=12, typical_p=0.001, seed=seed) for seed in (1, 2)
    }
    free = {client.text_generation(PROMPT, max_new_tokens=12, do_sample=True, seed=seed) for seed in (1, 2)}
    assert len(typical) == 1 and len(free) == 2
    langchain_defaults = {"temperature": 0.8, "top_p": 0.95, "typical_p": 0.95, "do_sample": False}
    answers = [
        client.text_generation(PROMPT, max_new_tokens=12, watermark=False, seed=seed, **langchain_defaults)
        for seed in (3, 3, 4)
    ]
    assert answers[0] == answers[1] != answers[2]  # sampled: another seed, another answer


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}


@pytest.mark.parametrize(
    "response_format",
    [
        # huggingface_hub sends this as TGI's {"type": "json_object", "value": schema}
        {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}},
        {"type": "json", "value": CITY},
    ],
    ids=["openai-form-sent-as-json_object-and-value", "json"],
)
def test_a_chat_format_from_tgis_client_is_followed_with_its_schema(server, response_format):
    """Read as OpenAI's json_object, a schema in TGI's `value` would be dropped: any object would do."""
    chat = InferenceClient(base_url=server.url, timeout=120)
    for seed in (1, 2):
        answer = chat.chat_completion(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a place."}],
            response_format=response_format,
            max_tokens=20,
            temperature=1.0,
            seed=seed,
        )
        assert json.loads(answer.choices[0].message.content) in ({"city": "Paris"}, {"city": "Lyon"})


def test_a_chat_regex_a_schema_in_value_and_a_grammar_as_json_object_in_tgis_form(server, client):
    chat = InferenceClient(base_url=server.url, timeout=120)
    year = chat.chat_completion(
        model=MODEL,
        messages=[{"role": "user", "content": "A year?"}],
        response_format={"type": "regex", "value": "(19|20)[0-9]{2}"},
        max_tokens=8,
    )
    assert re.fullmatch("(19|20)[0-9]{2}", year.choices[0].message.content)
    body = {  # (huggingface_hub reads a json_schema format as OpenAI's, so sent raw)
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a place."}],
        "response_format": {"type": "json_schema", "value": {"name": "place", "schema": CITY}},
    }
    place = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert json.loads(place["choices"][0]["message"]["content"]) in ({"city": "Paris"}, {"city": "Lyon"})
    answer = client.text_generation(PROMPT, max_new_tokens=20, grammar={"type": "json_object", "value": CITY})
    assert json.loads(answer) in ({"city": "Paris"}, {"city": "Lyon"})


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "json"}, "response_format"),
        ({"type": "regex", "value": "(unclosed"}, "response_format.value"),
        ({"type": "json_schema", "value": "{}"}, "response_format.value"),
        ({"type": "json_object", "value": {"type": "object", "uniqueItems": 3}}, "response_format.value"),
    ],
)
def test_a_bad_chat_format_in_tgis_form_is_a_400_naming_it(server, response_format, param):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": response_format,
    }
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_each_route_answers_as_the_document_says(server, stream):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True, "top_n_tokens": 2}}
    path = "/generate_stream" if stream else "/generate"
    documented(requests.post(f"{server.url}{path}", json=body, timeout=120), "post", path)
    compat = requests.post(f"{server.url}/", json={**body, "stream": stream}, timeout=120)
    documented(compat, "post", "/")
    if not stream:  # TGI's `/` answers a list of one
        assert (
            compat.json()[0]["generated_text"]
            == requests.post(f"{server.url}/generate", json=body, timeout=120).json()["generated_text"]
        )
    info = documented(requests.get(f"{server.url}/info", timeout=10), "get", "/info")
    assert (info["model_id"], info["max_total_tokens"]) == (MODEL, 1024)


@pytest.mark.parametrize(
    ("parameters", "names"),
    [
        ({"temperature": 0}, "parameters.temperature"),
        ({"top_p": 1.5}, "parameters.top_p"),
        ({"best_of": 2}, "parameters.best_of"),
        ({"watermark": True}, "parameters.watermark"),
        ({"typical_p": 1.5}, "parameters.typical_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "parameters.stop"),
        ({"top_n_tokens": 6}, "parameters.top_n_tokens"),
        ({"grammar": {"type": "lark", "value": "start: x"}}, "parameters.grammar"),
        ({"grammar": {"type": "regex", "value": "(unclosed"}}, "parameters.grammar.value"),
        ({"max_new_tokens": 5000}, "parameters.max_new_tokens"),
    ],
)
def test_bad_parameters_are_a_validation_error_naming_them(server, parameters, names):
    response = requests.post(
        f"{server.url}/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=30
    )
    body = documented(response, "post", "/generate")
    assert response.status_code == 400 and body["error_type"] == "validation"
    assert body["error"].startswith(names), body


def test_the_client_raises_its_validation_error_and_a_stream_takes_no_input_details(client, server):
    with pytest.raises(ValidationError, match="temperature"):
        client.text_generation(PROMPT, temperature=0.0)
    body = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    response = requests.post(f"{server.url}/generate_stream", json=body, timeout=30)
    assert response.status_code == 400 and "decoder_input_details" in response.json()["error"]
    too_long = requests.post(f"{server.url}/generate", json={"inputs": "hi " * 2000}, timeout=30)
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]
    missing = requests.post(f"{server.url}/generate", json={"parameters": {}}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"].startswith("inputs")


def test_the_mock_streams_tokens_of_no_id(mock_server):
    """The mock backend scores nothing: its tokens come with no id and no logprob, its text all the same."""
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True}}
    response = requests.post(f"{mock_server.url}/generate_stream", json=body, timeout=30)
    documented(response, "post", "/generate_stream")
    events = [json.loads(line.removeprefix("data:")) for line in response.text.splitlines() if line]
    assert len(events) == 5 and all(event["token"]["id"] is None for event in events)
    assert events[-1]["generated_text"] == "".join(event["token"]["text"] for event in events) != ""
