"""Ollama's API (inference_api/apis/ollama) through Ollama's own Python client and LangChain's
ChatOllama, unchanged, on the default model in the exact mode, straight and through the proxy with the
team's token as a header. Each answer is held to the OpenAI API's on the same prompt (greedy text, token
counts, embeddings), so that the API adds its shapes and nothing else. (A stream cut by a failing
backend: tests/compat/test_mid_stream_failures.py; the shapes against openapi.json: its e2e test.)"""

from __future__ import annotations

import json

import ollama
import pytest
import requests
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_ollama import ChatOllama, OllamaEmbeddings

from inference_api.apis.ollama.routes import modelfile_number
from tests.compat.conftest import MODEL
from tests.proxy.conftest import bearer
from tests.server_fixture import RunningServer

GREEDY = {"temperature": 0, "num_predict": 12}
QUESTION = "What is the capital of France?"
SYSTEM = "You answer in one sentence."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def weather_call(city: str) -> dict:
    call = {"function": {"name": "get_weather", "arguments": {"city": city}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def openai_shaped(messages: list[dict]) -> list[dict]:
    """The conversation as chat completions takes it: calls with JSON-string arguments and ids."""
    shaped = []
    for i, message in enumerate(messages):
        if "tool_calls" in message:
            function = message["tool_calls"][0]["function"]
            arguments = json.dumps(function["arguments"])
            call = {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
            message = {**message, "tool_calls": [call]}
        shaped.append({key: value for key, value in message.items() if key != "tool_name"})
    return shaped


# A conversation in which the model has called the tool twice: the greedy answer calls it again.
WEATHER_TALK = [
    {"role": "user", "content": "Weather in Paris?"},
    weather_call("Paris"),
    {"role": "tool", "content": "18 C", "tool_name": "get_weather"},
    {"role": "user", "content": "Weather in Rome?"},
    weather_call("Rome"),
    {"role": "tool", "content": "25 C", "tool_name": "get_weather"},
    {"role": "user", "content": "Weather in Berlin?"},
]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def openai_chat(server: RunningServer, messages: list[dict], **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12, **fields}
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()


def test_generate_answers_as_chat_does_on_the_prompt_as_a_users_message(server, client, tokenizer):
    answer = client.generate(model=MODEL, prompt=QUESTION, system=SYSTEM, options=GREEDY)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reference = openai_chat(server, messages, return_token_ids=True)
    assert answer.response == reference["choices"][0]["message"]["content"] and answer.done
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert answer.eval_count == reference["usage"]["completion_tokens"]
    assert answer.done_reason == reference["choices"][0]["finish_reason"] == "stop"
    # its context: the prompt's token ids and the answer's, to go on from
    assert answer.context == reference["prompt_token_ids"] + reference["choices"][0]["token_ids"]
    assert answer.total_duration >= answer.prompt_eval_duration > 0 and answer.eval_duration > 0


def test_a_raw_prompt_is_continued_as_completions_continues_it(server, client):
    answer = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    body = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 12}
    reference = requests.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    assert answer.response == reference["choices"][0]["text"]
    assert answer.done_reason == "length" and answer.eval_count == 12


def test_logprobs_are_the_completions_endpoints_whole_and_streamed(server, client):
    fields = {"model": MODEL, "prompt": "The capital of France is", "raw": True, "options": GREEDY}
    answer = client.generate(**fields, logprobs=True, top_logprobs=2)
    body = {"model": MODEL, "prompt": fields["prompt"], "temperature": 0, "max_tokens": 12, "logprobs": 2}
    reference = requests.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    expected = reference["choices"][0]["logprobs"]
    assert [entry.token for entry in answer.logprobs] == expected["tokens"]
    assert [entry.logprob for entry in answer.logprobs] == pytest.approx(expected["token_logprobs"], abs=1e-4)
    assert [len(entry.top_logprobs) for entry in answer.logprobs] == [2] * 12
    assert all(entry.top_logprobs[0].token == entry.token for entry in answer.logprobs)  # greedy
    parts = list(client.generate(**fields, logprobs=True, stream=True))
    streamed = [entry for part in parts for entry in part.logprobs or []]
    assert [entry.token for entry in streamed] == expected["tokens"]
    assert all(entry.top_logprobs == [] for entry in streamed)  # top_logprobs 0: none beside it
    assert client.generate(**fields).logprobs is None  # not asked, none


def test_the_context_goes_before_the_next_prompt(client, tokenizer):
    first = client.generate(model=MODEL, prompt=QUESTION, options=GREEDY)
    second = client.generate(model=MODEL, prompt="And of Italy?", context=first.context, options=GREEDY)
    alone = client.generate(model=MODEL, prompt="And of Italy?", options=GREEDY)
    assert second.prompt_eval_count == len(first.context) + alone.prompt_eval_count


def test_the_stream_is_the_whole_answer_a_line_a_piece(client):
    whole = client.generate(model=MODEL, prompt=QUESTION, options=GREEDY)
    parts = list(client.generate(model=MODEL, prompt=QUESTION, options=GREEDY, stream=True))
    assert "".join(part.response for part in parts) == whole.response and len(parts) > 2
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == whole.eval_count and parts[-1].context == whole.context
    chat = list(
        client.chat(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=GREEDY, stream=True
        )
    )
    assert "".join(part.message.content for part in chat) == whole.response


def test_chat_answers_as_chat_completions_and_a_model_may_carry_its_tag(server, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    answer = client.chat(model=f"{MODEL}:latest", messages=messages, options=GREEDY)
    reference = openai_chat(server, messages)
    assert answer.message.role == "assistant" and answer.model == MODEL
    assert answer.message.content == reference["choices"][0]["message"]["content"]
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]


def test_a_last_assistant_message_is_continued(server, client):
    """Ollama's templates go on from a last assistant message: a prefill, as vLLM's continue_final_message."""
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital"}]
    answer = client.chat(model=MODEL, messages=messages, options=GREEDY)
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    reference = openai_chat(server, messages, **continued)
    assert answer.message.content == reference["choices"][0]["message"]["content"]
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]


def test_a_conversation_with_calls_reads_as_chats_and_the_answer_calls_the_tool(server, client):
    """Ollama's calls carry their arguments as objects, and its tool messages name the tool."""
    answer = client.chat(
        model=MODEL, messages=WEATHER_TALK, tools=[WEATHER], options=GREEDY | {"num_predict": 60}
    )
    assert answer.message.content == "" and answer.done_reason == "stop"
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Berlin"}
    reference = openai_chat(server, openai_shaped(WEATHER_TALK), tools=[WEATHER], max_tokens=60)
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert json.loads(reference["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Berlin"
    }


def test_langchains_chat_ollama_answers_calls_and_embeds_as_the_client(server, client):
    """LangChain's Ollama integration (langchain-ollama), unchanged: its messages and tool calls in
    Ollama's shapes, its stream, its embeddings."""
    chat = ChatOllama(model=MODEL, base_url=server.url, temperature=0, num_predict=12)
    reply = chat.invoke(QUESTION)
    expected = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=GREEDY)
    assert reply.content == expected.message.content
    assert "".join(chunk.content for chunk in chat.stream(QUESTION)) == reply.content
    talk = []
    for i, message in enumerate(WEATHER_TALK):
        if message["role"] == "user":
            talk.append(HumanMessage(message["content"]))
        elif message["role"] == "assistant":
            arguments = message["tool_calls"][0]["function"]["arguments"]
            talk.append(AIMessage("", tool_calls=[{"name": "get_weather", "args": arguments, "id": f"c{i}"}]))
        else:
            talk.append(ToolMessage(message["content"], tool_call_id=f"c{i - 1}"))
    tools = ChatOllama(model=MODEL, base_url=server.url, temperature=0, num_predict=60).bind_tools([WEATHER])
    [call] = tools.invoke(talk).tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Berlin"}
    vector = OllamaEmbeddings(model=MODEL, base_url=server.url).embed_query("hello")
    assert vector == pytest.approx(client.embed(model=MODEL, input="hello").embeddings[0], abs=1e-5)


def test_format_holds_the_answer_to_json_or_a_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    shaped = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        format=schema,
        options=GREEDY | {"num_predict": 40},
    )
    assert set(json.loads(shaped.message.content)) == {"city"}
    anything = client.generate(
        model=MODEL, prompt=QUESTION, format="json", options=GREEDY | {"num_predict": 40}
    )
    assert isinstance(json.loads(anything.response), dict)


def test_embed_gives_the_embeddings_endpoints_vectors(server, client):
    vectors = client.embed(model=MODEL, input=["hello", "the capital of France"])
    body = {"model": MODEL, "input": ["hello", "the capital of France"]}
    reference = requests.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    for vector, item in zip(vectors.embeddings, reference["data"], strict=True):
        assert vector == pytest.approx(item["embedding"], abs=1e-5)  # float32, batched otherwise
    assert vectors.prompt_eval_count == reference["usage"]["prompt_tokens"]
    single = client.embeddings(model=MODEL, prompt="hello")
    assert single.embedding == pytest.approx(vectors.embeddings[0], abs=1e-5)


def test_an_input_too_long_is_cut_at_its_end_unless_truncate_is_false(client):
    long = "word " * 2000
    cut = client.embed(model=MODEL, input=long)
    assert cut.prompt_eval_count < 1024 and len(cut.embeddings) == 1
    with pytest.raises(ollama.ResponseError) as failure:
        client.embed(model=MODEL, input=long, truncate=False)
    assert failure.value.status_code == 400 and "truncate" in failure.value.error


def test_the_model_list_show_and_ps_describe_the_served_model(server, client):
    assert [model.model for model in client.list().models] == [MODEL]
    [loaded] = client.ps().models
    assert loaded.model == MODEL and loaded.context_length == 1024
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools"]  # no fill-in-the-middle tokens, no thoughts
    assert shown.template and shown.details.quantization_level == "float32"
    version = requests.get(f"{server.url}/api/version", timeout=10).json()["version"]
    assert version.count(".") == 2


def test_typical_p_keeps_one_token_a_step_at_its_smallest_whatever_the_seed(client):
    sampled = {"num_predict": 12, "temperature": 1, "top_k": 0, "top_p": 1}
    answers = {
        typical_p: {
            client.generate(
                model=MODEL, prompt=QUESTION, options={**sampled, "typical_p": typical_p, "seed": seed}
            ).response
            for seed in (1, 2)
        }
        for typical_p in (0.001, 1)
    }
    assert len(answers[0.001]) == 1 and len(answers[1]) == 2


@pytest.mark.parametrize(
    "call, status, says",
    [
        (lambda c: c.chat(model="llama3", messages=[{"role": "user", "content": "hi"}]), 404, "llama3"),
        (lambda c: c.generate(model=MODEL, prompt="hi", options={"top_p": 0}), 400, "options.top_p"),
        (lambda c: c.generate(model=MODEL, prompt="hi", options={"mirostat": 2}), 400, "options.mirostat"),
        (
            lambda c: c.generate(model=MODEL, prompt="hi", options={"typical_p": 1.5}),
            400,
            "options.typical_p",
        ),
        (lambda c: c.generate(model=MODEL, prompt="hi", suffix="there"), 400, "fill-in-the-middle"),
        (
            lambda c: c.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], think=True),
            400,
            "thinking",
        ),
        (lambda c: c.generate(model=MODEL, prompt="hi " * 2000), 400, "context length"),
        (lambda c: c.chat(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
        (lambda c: c.generate(model=MODEL, prompt="hi", top_logprobs=3), 400, "top_logprobs"),
        (lambda c: c.generate(model=MODEL, prompt="hi", logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ],
)
def test_bad_requests_are_the_clients_response_errors(client, call, status, says):
    with pytest.raises(ollama.ResponseError) as failure:
        call(client)
    assert failure.value.status_code == status and says in failure.value.error


def test_an_empty_prompt_loads_the_model_at_once(client):
    loaded = client.generate(model=MODEL, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"


def test_through_the_proxy_the_team_token_is_a_header(proxy):
    through = ollama.Client(host=proxy.url, headers=bearer(), timeout=120)
    assert through.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=GREEDY).done
    with pytest.raises(ollama.ResponseError) as failure:
        ollama.Client(host=proxy.url, timeout=30).list()
    assert failure.value.status_code == 401


@pytest.mark.parametrize("num_predict, arguments", [(21, {}), (23, {"city": "Berlin"})])
def test_a_call_cut_by_num_predict_keeps_the_members_written_whole(server, client, num_predict, arguments):
    """A call cut in its arguments (`{"city": "Ber` at 21 tokens, `{"city": "Berlin"` at 23): Ollama's
    arguments are an object, so they are the members written whole before the cut, as Anthropic's `input`
    is, where the chat completions API gives the JSON string as written."""
    options = GREEDY | {"num_predict": num_predict}
    answer = client.chat(model=MODEL, messages=WEATHER_TALK, tools=[WEATHER], options=options)
    assert answer.done_reason == "length"
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == arguments
    reference = openai_chat(server, openai_shaped(WEATHER_TALK), tools=[WEATHER], max_tokens=num_predict)
    assert reference["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].startswith(
        '{"city": "Ber'
    )


def test_show_writes_a_modelfiles_numbers_as_ollama_does():
    assert [modelfile_number(value) for value in (0.0, 0.6, 20, 1_048_576, 1e-05)] == [
        "0",
        "0.6",
        "20",
        "1048576",
        "1e-05",
    ]
