"""llama.cpp server's own /completion, /apply-template, /props, /tokenize, /detokenize and /embedding
(inference_api/apis/llamacpp, apis/tokenize.py), over raw
HTTP as its scripts call them, on the default model in the exact mode. The answers are held to the
OpenAI API's on the same prompt (greedy text, token ids and logprobs), so that the API adds a shape and
nothing else; what editors' plugins add to end an answer early (n_indent, t_max_predict_ms) and to pick
its fields, to the same answer without them. /infill: tests/compat/test_fill_in_middle.py."""

from __future__ import annotations

import json

import pytest
import requests

from tests.compat.conftest import MODEL
from tests.frontend.test_openapi_e2e import documented
from tests.server_fixture import RunningServer

PROMPT = "The capital of France is"
GREEDY = {"prompt": PROMPT, "temperature": 0, "n_predict": 8}
PLACE = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}


def llama(server: RunningServer, **fields) -> requests.Response:
    return requests.post(f"{server.url}/completion", json=fields, timeout=120)


def openai_completion(server: RunningServer, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "logprobs": 2, **fields}
    return requests.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]


def test_a_greedy_answer_is_the_completions_endpoints_with_llama_servers_fields(server, tokenizer):
    answer = documented(llama(server, **GREEDY, return_tokens=True, n_probs=2), "post", "/completion")
    reference = openai_completion(server, max_tokens=8)
    assert answer["content"] == reference["text"] and answer["stop"] is True
    assert tokenizer.decode(answer["tokens"]) == answer["content"]
    assert answer["tokens_predicted"] == len(answer["tokens"]) == 8 and answer["stop_type"] == "limit"
    assert answer["tokens_evaluated"] == len(tokenizer(PROMPT).input_ids)
    assert answer["generation_settings"]["n_predict"] == 8 and answer["timings"]["predicted_n"] == 8
    probabilities = answer["completion_probabilities"]
    assert [entry["logprob"] for entry in probabilities] == pytest.approx(
        reference["logprobs"]["token_logprobs"], abs=1e-4
    )
    assert [len(entry["top_logprobs"]) for entry in probabilities] == [2] * 8
    assert [entry["top_logprobs"][0]["id"] for entry in probabilities] == answer["tokens"]  # greedy


def test_the_stream_is_the_whole_answer_a_piece_an_event_and_the_last_says_why_it_ended(server):
    whole = llama(server, **{**GREEDY, "n_predict": 20, "stop": ["."]}).json()
    response = requests.post(
        f"{server.url}/completion",
        json={**GREEDY, "n_predict": 20, "stop": ["."], "stream": True},
        stream=True,
    )
    documented(response, "post", "/completion")
    events = [
        json.loads(line[len(b"data: ") :]) for line in response.iter_lines() if line.startswith(b"data: ")
    ]
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert "".join(event["content"] for event in events) == whole["content"]
    assert [event["stop"] for event in events] == [False] * (len(events) - 1) + [True]
    assert whole["stop_type"] == events[-1]["stop_type"] == "word" and whole["stopping_word"] == "."
    assert sum(len(event["tokens"]) for event in events) == whole["tokens_predicted"]


def test_a_gbnf_grammar_and_a_json_schema_constrain_the_answer(server):
    grammar = 'root ::= " " answer\nanswer ::= "yes" | "no"'
    answered = llama(
        server, prompt="Is Paris in France? Answer yes or no:", n_predict=8, grammar=grammar
    ).json()
    assert answered["content"] in (" yes", " no") and answered["stop_type"] == "eos"
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    shaped = llama(server, prompt="The capital of France as JSON:", n_predict=40, json_schema=schema).json()
    assert set(json.loads(shaped["content"])) == {"city"}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mirostat": 2}, "mirostat"),
        ({"typical_p": 0}, "typical_p"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"grammar": "root ::= undefined"}, "grammar"),
        ({"grammar": "root ::= a\na ::= root"}, "grammar"),  # no text can follow it
        ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
        ({"logit_bias": [[10**9, 1.0]]}, "logit_bias"),
        ({"n_predict": -2}, "n_predict"),
        ({"n_predict": 10**6}, "n_predict"),
        ({"n_indent": -1}, "n_indent"),
        ({"t_max_predict_ms": "soon"}, "t_max_predict_ms"),
        ({"t_max_prompt_ms": -5}, "t_max_prompt_ms"),
        ({"response_fields": [1]}, "response_fields"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(server, fields, named):
    response = llama(server, **{**GREEDY, **fields})
    assert response.status_code == 400
    assert named in response.json()["error"]["message"]


@pytest.mark.parametrize("schema", [PLACE, json.dumps(PLACE)])
def test_a_chat_format_of_a_json_object_with_a_schema_follows_the_schema(server, schema):
    """llama-server's OpenAI-compatible chat takes `{"type": "json_object", "schema": ...}`, as LangChain's
    ChatHuggingFace sends a json_schema structured output: read as OpenAI's json_object alone, any object
    would do."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a place."}],
        "response_format": {"type": "json_object", "schema": schema},
        "max_tokens": 20,
    }
    for seed in (1, 2):
        answer = requests.post(f"{server.url}/v1/chat/completions", json={**body, "seed": seed}, timeout=120)
        assert json.loads(answer.json()["choices"][0]["message"]["content"]) in (
            {"city": "Paris"},
            {"city": "Lyon"},
        )
    bad = {**body, "response_format": {"type": "json_object", "schema": {"type": "object", "uniqueItems": 3}}}
    refused = requests.post(f"{server.url}/v1/chat/completions", json=bad, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.schema"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_llama_servers_grammar_and_json_schema_constrain_its_openai_endpoints_too(server, path):
    """Code written for llama-server sends its `grammar` (GBNF) and `json_schema` to the OpenAI-compatible
    endpoints too (llama-cpp-python's clients among them), where they were ignored: free text came back."""
    body = {"model": MODEL, "max_tokens": 20}
    body |= (
        {"messages": [{"role": "user", "content": "Yes or no?"}]}
        if "chat" in path
        else {"prompt": "Yes or no?"}
    )

    def answer(**fields) -> requests.Response:
        return requests.post(f"{server.url}{path}", json={**body, **fields}, timeout=120)

    def text(response: requests.Response) -> str:
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if "chat" in path else choice["text"]

    for seed in (1, 2):
        assert text(answer(grammar='root ::= "yes" | "no"', seed=seed)) in ("yes", "no")
        assert json.loads(text(answer(json_schema=PLACE, seed=seed))) in ({"city": "Paris"}, {"city": "Lyon"})
    assert answer(grammar="").status_code == 200  # llama-server's "no grammar"
    for fields, named in (
        ({"grammar": "root ::= ("}, "grammar"),
        ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "grammar"),
        ({"json_schema": {"type": "object", "uniqueItems": 3}}, "json_schema"),
    ):
        refused = answer(**fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == named, refused.text


def test_typical_p_keeps_one_token_a_step_at_its_smallest_whatever_the_seed(server):
    sampled = {"prompt": PROMPT, "n_predict": 12, "temperature": 1, "top_k": 0, "top_p": 1, "min_p": 0}
    typical = {llama(server, **sampled, typical_p=0.001, seed=seed).json()["content"] for seed in (1, 2)}
    free = {llama(server, **sampled, seed=seed).json()["content"] for seed in (1, 2)}
    assert len(typical) == 1 and len(free) == 2


CODE = {"prompt": "def fib(n):\n    if n < 2:\n", "temperature": 0, "n_predict": 48}


def indented_part(text: str, n_indent: int) -> str:
    """The text up to the first line after its first with fewer than n_indent spaces or tabs, that
    line's indentation kept (llama-server's n_indent cut). A line is judged once it has a character
    past its indentation: a line break (a blank line) counts; the text's last line may have none yet."""
    lines = text.split("\n")
    for i, line in enumerate(lines[1:], start=1):
        indentation = len(line) - len(line.lstrip(" \t"))
        judged = i < len(lines) - 1 or indentation < len(line)
        if judged and indentation < n_indent:
            return "\n".join(lines[:i]) + "\n" + line[:indentation]
    return text


def test_n_indent_ends_the_answer_at_a_line_indented_less(server):
    """What an editor asks for inside a function's body: its lines, not the code after it. The first
    line is the rest of the cursor's own, never judged."""
    free = llama(server, **CODE).json()
    expected = indented_part(free["content"], 4)
    assert expected != free["content"] and expected.count("\n") >= 2  # the model went on past the body
    cut = documented(llama(server, **CODE, n_indent=4), "post", "/completion")
    assert cut["content"] == expected and cut["stop_type"] == "limit"
    assert cut["tokens_predicted"] < free["tokens_predicted"]
    streamed = requests.post(
        f"{server.url}/completion", json={**CODE, "n_indent": 4, "stream": True}, stream=True, timeout=120
    )
    events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert "".join(event["content"] for event in events) == expected and events[-1]["stop_type"] == "limit"


def test_t_max_predict_ms_ends_the_answer_at_a_line_break_once_its_time_is_up(server):
    free = llama(server, **CODE).json()
    hurried = llama(server, **CODE, t_max_predict_ms=1).json()
    assert free["content"].startswith(hurried["content"]) and hurried["stop_type"] == "limit"
    assert "\n" in hurried["content"] and hurried["content"].count("\n") < free["content"].count("\n")
    assert hurried["tokens_predicted"] < free["tokens_predicted"]
    patient = llama(server, **CODE, t_max_predict_ms=60_000).json()  # a minute: never reached
    assert patient["content"] == free["content"] and patient["stop_type"] == free["stop_type"]


def test_response_fields_give_those_fields_keyed_by_their_paths(server):
    paths = ["content", "timings/predicted_n", "generation_settings/n_predict", "absent", "timings/absent"]
    whole = llama(server, **GREEDY).json()
    picked = documented(llama(server, **GREEDY, response_fields=paths), "post", "/completion")
    assert picked == {
        "content": whole["content"],
        "timings/predicted_n": 8,
        "generation_settings/n_predict": 8,
    }
    streamed = requests.post(
        f"{server.url}/completion",
        json={**GREEDY, "response_fields": paths, "stream": True},
        stream=True,
        timeout=120,
    )
    events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert set(events[-1]) == {"content", "timings/predicted_n", "generation_settings/n_predict"}
    assert all(event["stop"] is False for event in events[:-1])  # the pieces stay whole


def test_a_banned_token_is_never_chosen_and_the_prompt_may_come_as_token_ids(server, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    free = llama(server, prompt=ids, temperature=0, n_predict=1, return_tokens=True).json()
    assert free["content"] == llama(server, **{**GREEDY, "n_predict": 1}).json()["content"]
    banned = llama(
        server,
        prompt=ids,
        temperature=0,
        n_predict=1,
        return_tokens=True,
        logit_bias=[[free["tokens"][0], False]],
    )
    assert banned.json()["tokens"] != free["tokens"]


def test_apply_template_renders_the_chat_and_props_describe_the_server(server, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = documented(
        requests.post(f"{server.url}/apply-template", json={"messages": messages}, timeout=30),
        "post",
        "/apply-template",
    )
    assert rendered["prompt"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prefilled = llama(server, prompt=rendered["prompt"] + "The capital", temperature=0, n_predict=4).json()
    chat = requests.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [*messages, {"role": "assistant", "content": "The capital"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "temperature": 0,
            "max_tokens": 4,
        },
        timeout=60,
    ).json()
    assert prefilled["content"] == chat["choices"][0]["message"]["content"]
    tool = {"type": "function", "function": {"name": "capital_of", "parameters": {"type": "object"}}}
    with_tools = requests.post(
        f"{server.url}/apply-template", json={"messages": messages, "tools": [tool]}, timeout=30
    ).json()
    assert "capital_of" in with_tools["prompt"]
    refused = requests.post(f"{server.url}/apply-template", json={"messages": []}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    props = documented(requests.get(f"{server.url}/props", timeout=30), "get", "/props")
    assert props["total_slots"] == 8 and props["default_generation_settings"]["n_ctx"] == 1024
    assert props["model_path"] == MODEL and props["chat_template"] == tokenizer.chat_template


def test_tokenize_detokenize_and_embedding_in_llama_servers_shapes(server, tokenizer):
    """/tokenize's ids are the model tokenizer's, special tokens' texts read as those tokens unless
    parse_special is false; each piece's bytes join into the text, an emoji's parts as bytes; /detokenize
    gives the text back, special tokens' texts included; /embedding's vector is /v1/embeddings'."""

    def tokenized(**fields) -> list:
        return documented(
            requests.post(f"{server.url}/tokenize", json=fields, timeout=30), "post", "/tokenize"
        )["tokens"]

    text = "<|im_start|>user\nA party 🎉"
    assert tokenized(content=text) == tokenizer(text, add_special_tokens=False).input_ids
    assert tokenized(content=text, add_special=True) == tokenizer(text).input_ids
    plain = tokenized(content=text, parse_special=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in plain
    assert tokenizer.decode(plain) == text and len(plain) > len(tokenized(content=text))
    pieces = tokenized(content=text, with_pieces=True)
    assert [piece["id"] for piece in pieces] == tokenized(content=text)
    assert pieces[0] == {"id": tokenizer.convert_tokens_to_ids("<|im_start|>"), "piece": "<|im_start|>"}
    parts = [piece["piece"] for piece in pieces]
    assert any(isinstance(part, list) for part in parts)  # the emoji's tokens are parts of its bytes
    joined = b"".join(bytes(part) if isinstance(part, list) else part.encode() for part in parts)
    assert joined == text.encode()

    back = requests.post(f"{server.url}/detokenize", json={"tokens": tokenized(content=text)}, timeout=30)
    assert documented(back, "post", "/detokenize") == {"prompt": text, "content": text}

    inputs = ["A party", "The capital of France"]
    vectors = requests.post(f"{server.url}/embedding", json={"content": inputs}, timeout=60)
    reference = requests.post(
        f"{server.url}/v1/embeddings", json={"model": MODEL, "input": inputs}, timeout=60
    )
    answer = documented(vectors, "post", "/embedding")
    assert [entry["index"] for entry in answer] == [0, 1]
    for entry, expected in zip(answer, reference.json()["data"], strict=True):
        assert entry["embedding"] == [pytest.approx(expected["embedding"], abs=1e-5)]
