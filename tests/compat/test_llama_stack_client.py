"""Llama Stack's own client (llama-stack-client 0.2.12), unchanged, against the real server on the default
model: its model list, its inference API (completion and chat completion, whole and streamed, and
embeddings) and its OpenAI-compatible routes (/v1/openai/v1/...), as its users call them."""

from __future__ import annotations

import math

import llama_stack_client
import pytest
from llama_stack_client import LlamaStackClient
from llama_stack_client.types import Model

from tests.compat.conftest import MODEL, template_tokens

STORY = [{"role": "user", "content": "Write a story about a dragon who learns to bake bread."}]
GREEDY = {"strategy": {"type": "greedy"}, "max_tokens": 10}


@pytest.fixture(scope="module")
def llama(server) -> LlamaStackClient:
    return LlamaStackClient(base_url=server.url, max_retries=0, timeout=120)


def metrics_of(answer) -> dict[str, float]:
    return {metric.metric: metric.value for metric in answer.metrics}


def test_the_model_list_gives_the_served_model_as_an_llm_with_its_identifier(llama):
    [model] = llama.models.list()
    assert model.identifier == MODEL and model.api_model_type == "llm" and model.type == "model"
    assert model.provider_id == "inference-server" and model.provider_resource_id == MODEL
    assert model.metadata == {}
    # The client builds its models without validating them (a missing field reads None): validate the
    # answer as its type declares it, every required field there with its type.
    raw = llama.models.with_raw_response.list().http_response.json()["data"][0]
    assert Model.model_validate(raw).identifier == MODEL
    assert llama.models.retrieve(MODEL).identifier == MODEL
    with pytest.raises(llama_stack_client.NotFoundError):
        llama.models.retrieve("llama")


def test_a_chat_completion_streamed_is_the_one_answered_whole(llama, tokenizer):
    whole = llama.inference.chat_completion(model_id=MODEL, messages=STORY, sampling_params=GREEDY)
    message = whole.completion_message
    assert message.role == "assistant" and message.content and message.tool_calls == []
    assert message.stop_reason == "out_of_tokens"
    prompt_tokens = template_tokens(tokenizer, STORY)
    assert metrics_of(whole) == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 10,
        "total_tokens": prompt_tokens + 10,
    }

    chunks = list(
        llama.inference.chat_completion(model_id=MODEL, messages=STORY, sampling_params=GREEDY, stream=True)
    )
    kinds = [chunk.event.event_type for chunk in chunks]
    assert kinds == ["start", *["progress"] * (len(chunks) - 2), "complete"] and len(chunks) > 5
    assert "".join(chunk.event.delta.text for chunk in chunks) == message.content
    assert chunks[-1].event.stop_reason == "out_of_tokens"
    assert metrics_of(chunks[-1]) == metrics_of(whole)


def test_a_completion_streamed_is_the_one_answered_whole(llama):
    asked = {"model_id": MODEL, "content": "The three laws of robotics are", "sampling_params": GREEDY}
    whole = llama.inference.completion(**asked)
    assert whole.content and whole.stop_reason == "out_of_tokens"
    chunks = list(llama.inference.completion(**asked, stream=True))
    assert "".join(chunk.delta for chunk in chunks) == whole.content and len(chunks) > 4
    assert chunks[-1].stop_reason == "out_of_tokens"


def test_embeddings_are_one_unit_vector_per_content_as_v1_embeddings_gives_them(llama):
    contents = ["A dragon bakes bread.", {"type": "text", "text": "A dragon bakes bread."}, "Rain in Paris."]
    vectors = llama.inference.embeddings(model_id=MODEL, contents=contents).embeddings
    assert len(vectors) == 3 and len({len(vector) for vector in vectors}) == 1 and len(vectors[0]) > 100
    assert all(math.isclose(math.hypot(*vector), 1.0, rel_tol=1e-4) for vector in vectors)
    # The same text, in another row of the batch: the same vector, to float32's rounding.
    assert vectors[1] == pytest.approx(vectors[0], abs=1e-6)
    assert vectors[2] != pytest.approx(vectors[0], abs=1e-2)
    # The client's OpenAI-compatible route (/v1/openai/v1/embeddings) embeds as the same machinery does.
    openai_style = llama.embeddings.create(model=MODEL, input=["A dragon bakes bread."])
    assert openai_style.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)


@pytest.mark.parametrize(
    "field, asked",
    [
        ("contents[1]", {"contents": ["hi", {"type": "image", "image": {"url": {"uri": "a.png"}}}]}),
        ("output_dimension", {"contents": ["hi"], "output_dimension": 64}),
        ("task_type", {"contents": ["hi"], "task_type": "query"}),
        ("text_truncation", {"contents": ["hi"], "text_truncation": "middle"}),
    ],
)
def test_what_embeddings_do_not_build_is_a_400_naming_it(llama, field, asked):
    with pytest.raises(llama_stack_client.BadRequestError) as refused:
        llama.inference.embeddings(model_id=MODEL, **asked)
    assert refused.value.body["detail"].startswith(f"{field} ")


def test_the_openai_compatible_chat_route_streams_what_it_answers_whole(llama):
    asked = {"model": MODEL, "messages": STORY, "max_tokens": 10, "temperature": 0}
    whole = llama.chat.completions.create(**asked)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert whole.model == MODEL
    chunks = list(llama.chat.completions.create(**asked, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    completion = llama.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
