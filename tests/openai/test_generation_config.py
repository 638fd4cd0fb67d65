"""The sampling a model's generation_config.json recommends is the default of the fields a request leaves
out, in the OpenAI, Responses, Anthropic and Ollama APIs (--generation-config auto, as vLLM's), through
the official clients; the request's own values win, and `vllm` leaves the model's out.

A tiny random model whose file says temperature 0 (greedy) and max_new_tokens 5: a request that gives no
temperature is greedy, the same text whatever its seed, and 5 tokens long."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from tests.backend.models import write_tiny_byte_model
from tests.server_fixture import RunningServer, running_server

NAME = "tiny"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
QUESTION = [{"role": "user", "content": "Say something."}]
NO_STOP = {"ignore_eos": True}  # a random model may write its EOS at any step
RECOMMENDED = {"temperature": 0.0, "max_new_tokens": 5, "bos_token_id": 0}


def tiny_model_recommending(directory: Path, recommended: dict) -> Path:
    write_tiny_byte_model(directory, ("<|end|>",))
    (directory / "generation_config.json").write_text(json.dumps(recommended))  # over the one saved
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


def serve(directory: Path, *options: str) -> Iterator[RunningServer]:
    exact = ("--dtype", "float32", "--quantize", "none", "--rows", "4", "--max-seq-len", "256")
    with running_server("--model", str(directory), "--served-model-name", NAME, *exact, *options) as server:
        yield server


@pytest.fixture(scope="module")
def model_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_recommending(tmp_path_factory.mktemp("recommending"), RECOMMENDED)


@pytest.fixture(scope="module")
def recommended(model_directory: Path) -> Iterator[RunningServer]:
    yield from serve(model_directory)


@pytest.fixture(scope="module")
def apis_own(model_directory: Path) -> Iterator[RunningServer]:
    yield from serve(
        model_directory,
        "--generation-config",
        "vllm",
        "--override-generation-config",
        '{"max_new_tokens": 3}',
    )


def chat(server: RunningServer, seed: int, **fields):
    answer = server.openai_client().chat.completions.create(
        model=NAME, messages=QUESTION, seed=seed, extra_body=NO_STOP, **fields
    )
    return answer.choices[0].message.content, answer.usage.completion_tokens


def completion(server: RunningServer, seed: int, **fields):
    answer = server.openai_client().completions.create(
        model=NAME, prompt="Say something.", seed=seed, extra_body=NO_STOP, **fields
    )
    return answer.choices[0].text, answer.usage.completion_tokens


def test_the_models_recommendation_is_the_default_and_logged(recommended):
    for call in (chat, completion):
        texts = {call(recommended, seed) for seed in (1, 2, 3)}
        assert len(texts) == 1, texts  # greedy: the seed makes no difference
        assert next(iter(texts))[1] == 5  # max_new_tokens as the default max_tokens
    assert "sampling defaults for the fields a request leaves out" in recommended.log()
    assert "temperature 0, max_tokens 5" in recommended.log()


def test_the_requests_own_values_win(recommended):
    texts = {chat(recommended, seed, temperature=1.0, max_tokens=8) for seed in (1, 2, 3)}
    assert len(texts) == 3, texts
    assert {tokens for _, tokens in texts} == {8}


def test_the_responses_and_anthropic_apis_take_them_too(recommended):
    client = recommended.openai_client()
    responses = [client.responses.create(model=NAME, input="Say something.") for _ in range(3)]
    assert {response.temperature for response in responses} == {0.0}  # echoed as used
    assert len({response.output_text for response in responses}) == 1
    assert {response.usage.output_tokens for response in responses} <= {1, 2, 3, 4, 5}  # 5 unless EOS
    anthropic = recommended.anthropic_client()
    messages = [anthropic.messages.create(model=NAME, max_tokens=6, messages=QUESTION) for _ in range(3)]
    assert len({message.content[0].text if message.content else "" for message in messages}) == 1


def ollama_chat(server: RunningServer, seed: int, **options) -> tuple[str, int]:
    answer = ollama.Client(host=server.url, timeout=120).chat(
        model=NAME, messages=QUESTION, options={"seed": seed, **options}
    )
    return answer.message.content, answer.eval_count


def test_the_ollama_api_takes_them_as_a_modelfiles_parameters(recommended):
    texts = {ollama_chat(recommended, seed) for seed in (1, 2, 3)}
    assert len(texts) == 1, texts  # greedy, not Ollama's temperature 0.8
    assert next(iter(texts))[1] <= 5  # num_predict 5, not to the end of the context (5 unless EOS)
    assert len({ollama_chat(recommended, seed, temperature=1.0) for seed in (1, 2, 3)}) == 3
    shown = ollama.Client(host=recommended.url, timeout=30).show(NAME)  # as a Modelfile lists them
    assert shown.parameters == f"{'temperature':<30} 0\n{'num_predict':<30} 5"
    assert "PARAMETER temperature 0\nPARAMETER num_predict 5\n" in shown.modelfile


def test_vllm_leaves_the_models_out_and_the_override_goes_over(apis_own):
    texts = {chat(apis_own, seed) for seed in (1, 2, 3)}
    assert len(texts) == 3, texts  # OpenAI's temperature 1
    assert {tokens for _, tokens in texts} == {3}
    response = apis_own.openai_client().responses.create(model=NAME, input="Say something.")
    assert response.temperature == 1.0
    ollama_texts = {ollama_chat(apis_own, seed) for seed in (1, 2, 3)}
    assert len(ollama_texts) == 3, ollama_texts  # Ollama's temperature 0.8
    assert {tokens for _, tokens in ollama_texts} <= {1, 2, 3}  # the override's max_new_tokens
    assert ollama.Client(host=apis_own.url, timeout=30).show(NAME).parameters == f"{'num_predict':<30} 3"
    assert "temperature" not in apis_own.log().split("sampling defaults for the fields", 1)[-1].split("\n")[0]
