"""Ollama's API, for the apps and libraries written against an Ollama server (Open WebUI, the `ollama`
client, LangChain's ChatOllama, editors' plugins):

    GET  /api/version, /api/tags, /api/ps  the API version followed; the served model(s)
    POST /api/show      {"model"}  ->  its chat template, details and capabilities
    POST /api/generate  {"model", "prompt", "suffix"?, "system"?, "raw"?, "context"?, "options"?, ...}
    POST /api/chat      {"model", "messages", "tools"?, "format"?, "think"?, "options"?, ...}
    POST /api/embed     {"model", "input"}  ->  {"embeddings"}; /api/embeddings {"prompt"} -> {"embedding"}

Answers stream by default, as newline-delimited JSON objects (application/x-ndjson): each with `done`
false and a piece of `response` (generate) or of `message.content` (chat), a reasoning model's thoughts
in `thinking`, a chat's calls in `message.tool_calls` (arguments as objects); the last with `done` true,
`done_reason` ("stop" or "length"), the token counts, the durations in nanoseconds (measured in the
request thread: the prompt's is the wait for the first piece) and generate's `context` (the prompt's
and the answer's token ids, for the next prompt to go on from). With `stream` false, one object holds it
all. An empty prompt (generate) or no messages (chat) answers at once with `done_reason` "load", as
Ollama's preloading call does. A model may be named with Ollama's default tag (`name:latest`). Errors
are `{"error": message}` (errors.py), mid-stream as a line of their own.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Response, jsonify

from backend.messages import InvalidParams, TokenLogprob
from inference_api.apis.ollama.request import OllamaRequest, model_parameters, parse_chat, parse_generate
from inference_api.embedder import Cut, embed, embedding_ids
from inference_api.fields import read_bool
from inference_api.fill_in_middle import fill_tokens
from inference_api.generation import (
    EMBEDDINGS,
    GENERATE,
    NO_EVENT,
    ApiFields,
    Generation,
    GenerationFailed,
    check_model,
    coalesced,
    models_for,
    read_request,
    serving_now,
)
from inference_api.json_text import object_written
from inference_api.prompts import prompt_list
from inference_api.router import Serving
from inference_api.tokenizer import PromptTokenizer

bp = Blueprint("ollama_api", __name__, url_prefix="/api")

API_VERSION = "0.12.0"  # the Ollama release whose API this one follows
STARTED = datetime.now(UTC)
NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: the model stays loaded
GENERATE_FIELDS = ApiFields(prompt_ids="prompt", grammar="format", stop_token_ids="options.stop")
CHAT_FIELDS = ApiFields(prompt_ids="messages", grammar="format", stop_token_ids="options.stop")
EMBED_FIELDS = ApiFields(prompt_ids="input", count="input")


@bp.get("/version")
def version() -> Response:
    return jsonify(version=API_VERSION)


@bp.get("/tags")
def tags() -> Response:
    serving = serving_now()
    return jsonify(models=[_listed(name, serving) for name in _names(serving)])


@bp.get("/ps")
def running() -> Response:
    serving = serving_now()
    loaded = {"expires_at": NEVER, "size_vram": 0, "context_length": serving.backend.max_seq_len}
    return jsonify(models=[_listed(name, serving) | loaded for name in _names(serving)])


@bp.post("/show")
def show() -> Response:
    """What a listed model can do: the served model completion and tools (insert with fill-in-the-middle
    tokens, thinking for a reasoning model); a separate --embedding-model embedding only."""
    data, serving = read_request(model_field=None)
    field = "model" if "model" in data else "name"
    embedding = serving.backend.embedding_model
    if embedding is not None and data.get(field) in (embedding.name, f"{embedding.name}:latest"):
        name, template, context, capabilities = embedding.name, "", embedding.max_tokens, ["embedding"]
        parameters = {}
    else:
        name, template = _model(data, serving, field), serving.chat_template.source or ""
        context, capabilities = serving.backend.max_seq_len, ["completion", "tools"]  # tools: any model's
        capabilities += ["insert"] if fill_tokens(serving.tokenizer) is not None else []
        capabilities += ["thinking"] if serving.reads_reasoning else []
        parameters = model_parameters(serving)
    return jsonify(
        modelfile=f"# served by inference-server\nFROM {name}\n"
        + "".join(f"PARAMETER {option} {modelfile_number(value)}\n" for option, value in parameters.items()),
        parameters="\n".join(
            f"{option:<30} {modelfile_number(value)}" for option, value in parameters.items()
        ),
        template=template,
        details=_details(serving),
        model_info={"general.name": name, "general.context_length": context},
        capabilities=capabilities,
        modified_at=_time(STARTED),
    )


def modelfile_number(value: float | int) -> str:
    """As Go prints a Modelfile's number: 0.6, 0, 20, 1048576 (not Python's 1.04858e+06 of :g)."""
    return str(value) if isinstance(value, int) else f"{value:.15g}"


@bp.post("/generate")
def generate() -> Response:
    started = time.perf_counter()
    data, serving = read_request(model_field=None)
    model = _model(data, serving)
    asked = parse_generate(data, serving)
    if asked is None:
        return jsonify(model=model, created_at=_time(), response="", done=True, done_reason="load")
    return _answer(GenerateAnswer(model, asked), GENERATE_FIELDS, started, serving.tokenizer)


@bp.post("/chat")
def chat() -> Response:
    started = time.perf_counter()
    data, serving = read_request(model_field=None)
    model = _model(data, serving)
    if data.get("messages") in (None, []):
        message = {"role": "assistant", "content": ""}
        return jsonify(model=model, created_at=_time(), message=message, done=True, done_reason="load")
    return _answer(ChatAnswer(model, parse_chat(data, serving)), CHAT_FIELDS, started, serving.tokenizer)


@bp.post("/embed")
def embed_inputs() -> Response:
    """Each input's vector; an input longer than the model takes is cut at its end (Ollama's `truncate`,
    true by default), else a 400."""
    started = time.perf_counter()
    data, serving = read_request(model_field=None)
    model = _model(data, serving, endpoint=EMBEDDINGS)
    if data.get("dimensions") is not None:
        raise InvalidParams("dimensions", "dimensions is not supported: the vectors have the model's size")
    truncate = read_bool(data, "truncate", True)
    cut = Cut(-1, "right", "truncate", "truncate: true cuts it to fit") if truncate else Cut()
    inputs = embedding_ids(prompt_list(data.get("input"), "input"), serving, "input", cut)
    vectors = embed(inputs, EMBED_FIELDS)
    return jsonify(
        model=model,
        embeddings=[list(vector) for vector in vectors],
        total_duration=_nanoseconds(time.perf_counter() - started),
        load_duration=0,
        prompt_eval_count=sum(len(ids) for ids in inputs),
    )


@bp.post("/embeddings")
def embedding() -> Response:
    """Ollama's first embeddings route: one `prompt`, one `embedding` (none for an empty prompt)."""
    data, serving = read_request(model_field=None)
    _model(data, serving, endpoint=EMBEDDINGS)
    prompt = data.get("prompt")
    if prompt == "":
        return jsonify(embedding=[])
    inputs = embedding_ids(prompt_list(prompt, "prompt"), serving, "prompt")
    return jsonify(embedding=list(embed(inputs, ApiFields(prompt_ids="prompt", count="prompt"))[0]))


class Shape:
    """An answer's shapes to the request it answers, under the model's name as the request gave it."""

    def __init__(self, model: str, asked: OllamaRequest):
        self.model = model
        self.asked = asked


class GenerateAnswer(Shape):
    """/api/generate's shapes: `response` and `thinking`, and the tokens as `context` at the end."""

    def piece(self, reasoning: str, text: str) -> dict[str, Any]:
        thought = {"thinking": reasoning} if reasoning else {}
        return {"model": self.model, "created_at": _time(), "response": text, **thought, "done": False}

    def last(self, generation: Generation, stats: dict[str, Any], whole: tuple[str, str] = ("", "")) -> dict:
        answer = self.piece(*whole) | {"done": True, "done_reason": generation.finish_reason}
        return answer | {"context": self.asked.prompt_ids + generation.token_ids} | stats


class ChatAnswer(Shape):
    """/api/chat's shapes: an assistant's `message`, its calls in `tool_calls` at the end."""

    def piece(self, reasoning: str, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        message |= ({"thinking": reasoning} if reasoning else {}) | ({"tool_calls": calls} if calls else {})
        return {"model": self.model, "created_at": _time(), "message": message, "done": False}

    def last(self, generation: Generation, stats: dict[str, Any], whole: tuple[str, str] = ("", "")) -> dict:
        calls = _ollama_calls(generation.tool_calls)
        return self.piece(*whole, calls) | {"done": True, "done_reason": generation.finish_reason} | stats


def _answer(
    shape: GenerateAnswer | ChatAnswer, fields: ApiFields, started: float, tokenizer: PromptTokenizer
) -> Response:
    asked = shape.asked
    generation = Generation(asked.prompt_ids, asked.params, fields, asked.tools, asked.thinking)
    first_piece = time.perf_counter()  # Generation waited for it: the prompt is done
    logprobs = Logprobs(generation, tokenizer, asked=asked.params.logprobs is not None)
    if asked.stream:
        lines = _lines(shape, generation, started, first_piece, logprobs)
        lines = coalesced(lines, generation.choices.waiting)  # the lines of pieces already queued at once
        response = Response(lines, content_type="application/x-ndjson")
        response.call_on_close(generation.close)
        return response
    try:
        parts = {"reasoning": "", "text": ""}
        for kind, text in generation.parts():
            parts[kind] += text
    except GenerationFailed as failed:
        raise failed.error from None
    answer = shape.last(
        generation, _stats(generation, started, first_piece), (parts["reasoning"], parts["text"])
    )
    return jsonify(answer | logprobs.new())


def _lines(
    shape: GenerateAnswer | ChatAnswer,
    generation: Generation,
    started: float,
    first_piece: float,
    logprobs: Logprobs,
) -> Iterator[bytes]:
    try:
        for kind, text in generation.parts(marked=True):
            if not kind:
                yield NO_EVENT
                continue
            piece = shape.piece(text if kind == "reasoning" else "", text if kind == "text" else "")
            yield _line(piece | logprobs.new())
    except GenerationFailed as failed:
        yield _line({"error": str(failed)})
        return
    last = shape.last(generation, _stats(generation, started, first_piece))
    yield _line(last | logprobs.new())


class Logprobs:
    """The answer's tokens' logprobs in Ollama's shape, each line with those that came since the last
    (text held back, a call's say, comes later than its tokens' logprobs); none unless `asked`."""

    def __init__(self, generation: Generation, tokenizer: PromptTokenizer, asked: bool):
        self.generation = generation
        self.tokenizer = tokenizer
        self.asked = asked
        self.sent = 0

    def new(self) -> dict[str, Any]:
        if not self.asked:
            return {}
        entries = self.generation.logprobs[self.sent :]
        self.sent += len(entries)
        return {"logprobs": [self._entry(entry) for entry in entries]}

    def _entry(self, entry: TokenLogprob) -> dict[str, Any]:
        top = [self._token(token, logprob) for token, logprob in entry.top]
        return self._token(entry.token_id, entry.logprob) | {"top_logprobs": top}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, token_bytes = self.tokenizer.token_text(token_id), list(self.tokenizer.token_bytes(token_id))
        return {"token": text, "logprob": logprob, "bytes": token_bytes}


def _stats(generation: Generation, started: float, first_piece: float) -> dict[str, int]:
    """Ollama's counts and durations (nanoseconds): the prompt's time is the wait for the first piece."""
    now = time.perf_counter()
    return {
        "total_duration": _nanoseconds(now - started),
        "load_duration": 0,
        "prompt_eval_count": generation.prompt_tokens,
        "prompt_eval_duration": _nanoseconds(first_piece - started),
        "eval_count": generation.completion_tokens,
        "eval_duration": _nanoseconds(now - first_piece),
    }


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's calls (arguments a JSON string) in Ollama's shape: arguments as an object (of a call cut by
    num_predict, the members written whole)."""
    functions = [call["function"] for call in calls]
    return [
        {"function": {"index": i, "name": f["name"], "arguments": object_written(f["arguments"])}}
        for i, f in enumerate(functions)
    ]


def _model(data: dict[str, Any], serving: Serving, name: str = "model", endpoint: str = GENERATE) -> str:
    """The model the request names, which must be one answering at `endpoint`; Ollama's default tag may
    follow it (`name:latest`)."""
    model = data.get(name)
    if isinstance(model, str) and model.removesuffix(":latest") in models_for(serving, endpoint):
        model = model.removesuffix(":latest")
    check_model({name: model}, serving, name, endpoint=endpoint)
    return model


def _names(serving: Serving) -> list[str]:
    """Every model the server answers for: the served names, the LoRA adapters', and a separate embedding
    model's."""
    embedding = serving.backend.embedding_model
    return [*serving.generating_names, *([embedding.name] if embedding is not None else [])]


def _listed(name: str, serving: Serving) -> dict[str, Any]:
    """A model as /api/tags lists it; its size and digest are not known here (0, and its name's hash)."""
    digest = hashlib.sha256(name.encode()).hexdigest()
    listed = {"name": name, "model": name, "modified_at": _time(STARTED), "size": 0, "digest": digest}
    return listed | {"details": _details(serving)}


def _details(serving: Serving) -> dict[str, Any]:
    """What Ollama's details say of a model that this server knows: only the weights' dtype."""
    return {
        "parent_model": "",
        "format": "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": serving.backend.dtype,
    }


def _line(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


def _time(moment: datetime | None = None) -> str:
    return (moment or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)
