"""llama.cpp server's own API, for the scripts and tools written against llama-server:

    POST /completion      {"prompt", "n_predict", ...}  ->  {"content", "stop": true, "stop_type", ...}
                          stream: data: {"content", "tokens", "stop": false} a piece, then the whole
                          answer's fields with "stop": true in the last event
    POST /infill          {"input_prefix", "input_suffix", "input_extra"?, "prompt"?, ...}  ->  as
                          /completion: the code that fills the gap (a code model's: fill_in_middle.py)
    POST /apply-template  {"messages", "tools"?}  ->  {"prompt"}: the chat template's text, as chat renders it
    GET  /props           the context, the rows (its slots), the model, the chat template and the defaults
    POST /embedding       {"content" (or "input"): a text, ids, or a list of them}  ->
                          [{"index", "embedding": [vector]}]: each input's vector, as /v1/embeddings makes
                          it (also at /embeddings)

Whole, the answer has llama-server's fields: `content`, `tokens` (with `return_tokens`), `stop_type`
(`eos`, `word` for a stop string, with `stopping_word`, or `limit`), `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `generation_settings`, `timings` (measured here, in the request
thread: the prompt's time is the wait for the first piece), and with `n_probs` the
`completion_probabilities` of each token. Errors are OpenAI's shape, as llama-server's are.

Editors' plugins end an answer early on both routes: with `n_indent`, at a line after the first that is
indented less (cut before its text); with `t_max_predict_ms`, at a piece with a line break in the answer
once that long has passed since its first token. Either ends it with `stop_type` "limit", and the row
is freed. `response_fields` gives only those fields of the whole answer (streamed, of its last event),
each keyed by its path, as llama-server does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify

from backend.messages import Piece, TokenLogprob
from inference_api.apis.llamacpp.request import (
    DEFAULTS,
    LlamaCppRequest,
    parse_completion_request,
    parse_infill_request,
)
from inference_api.embedder import embed, embedding_ids
from inference_api.generation import (
    NO_EVENT,
    ApiFields,
    error_of,
    event_stream,
    read_all,
    read_request,
    serving_now,
    sse_event,
    start_choices,
)
from inference_api.prompts import chat_text, prompt_list, read_messages, template_kwargs, with_tools
from inference_api.router import Serving
from inference_api.tool_calls import read_tool_request

bp = Blueprint("llamacpp_api", __name__)
MISSING = object()  # a response_fields path the answer does not have

FIELDS = ApiFields(prompt_ids="prompt", grammar="grammar", stop_token_ids="stop", count="prompt")


@bp.post("/completion")
def completion() -> Response:
    started = time.perf_counter()
    data, serving = read_request(model_field=None)
    return _answer(parse_completion_request(data, serving), serving, started)


@bp.post("/infill")
def infill() -> Response:
    """The middle between `input_prefix` and `input_suffix`, which llama.vim and llama.vscode ask for as
    one types."""
    started = time.perf_counter()
    data, serving = read_request(model_field=None)
    return _answer(parse_infill_request(data, serving), serving, started)


def _answer(asked: LlamaCppRequest, serving: Serving, started: float) -> Response:
    choices, pieces = start_choices([(asked.prompt_ids, asked.params)], fields=FIELDS)
    answer = Answer(asked, serving, started)
    if asked.stream:
        return event_stream(_events(answer, answer.until_ended(pieces)), choices.close, choices.waiting)
    read_all(choices, answer.until_ended(pieces), FIELDS, answer.read)
    return jsonify(answer.fields(answer.whole()))


@bp.post("/apply-template")
def apply_template() -> Response:
    """The messages (and tools) as /v1/chat/completions renders them, as text to edit and send to
    /completion (a prefill, say)."""
    data, serving = read_request(model_field=None)
    messages = read_messages(data.get("messages"))
    tools = read_tool_request(data, serving.tool_parser, call_tags=serving.call_tags)
    messages, offered = with_tools(messages, tools, serving)
    text = chat_text(messages, serving, "messages", tools=offered, template_kwargs=template_kwargs(data))
    return jsonify(prompt=text)


@bp.post("/embedding")
@bp.post("/embeddings")
def embedding() -> Response:
    """Each input's vector, by the model /v1/embeddings answers with, in llama-server's own shape: a list of
    one vector (the pooled one) an input. `model` is not read, as llama-server serves one."""
    data, serving = read_request(model_field=None)
    field = "input" if data.get("input") is not None else "content"  # OpenAI's name first, as llama-server
    inputs = embedding_ids(prompt_list(data.get(field), field), serving, field)
    vectors = embed(inputs, ApiFields(prompt_ids=field, count=field))
    return jsonify([{"index": i, "embedding": [list(vector)]} for i, vector in enumerate(vectors)])


@bp.get("/props")
def props() -> Response:
    serving = serving_now()
    backend = serving.backend
    return jsonify(
        default_generation_settings={"n_ctx": backend.max_seq_len, "params": DEFAULTS},
        total_slots=backend.rows,
        model_path=serving.model_name,
        chat_template=serving.chat_template.source or "",
        modalities={"vision": False, "audio": False},
        build_info="inference-server",
    )


def _events(answer: Answer, pieces: Iterator[tuple[int, Piece]]) -> Iterator[bytes]:
    for _, piece in pieces:
        if piece.finish_reason == "error":  # too late for a status: llama-server's error event
            failed = error_of(piece, FIELDS)
            kind = "invalid_request_error" if failed.status < 500 else "server_error"
            yield sse_event({"error": {"code": failed.status, "message": failed.message, "type": kind}})
            return
        event = answer.read(piece)
        yield NO_EVENT if event is None else sse_event(event)


class Answer:
    """One request's answer as it comes: `read` each piece (its stream event, if any), then `whole()`."""

    def __init__(self, asked: LlamaCppRequest, serving: Serving, started: float):
        self.asked = asked
        self.serving = serving
        self.started = started
        self.first_piece = time.perf_counter()  # start_choices has waited for it: the prompt is done
        self.text = ""
        self.tokens: list[int] = []
        self.probabilities: list[dict[str, Any]] = []
        self.last: Piece | None = None
        self.limited = False  # ended early by n_indent or t_max_predict_ms

    def read(self, piece: Piece) -> dict[str, Any] | None:
        text = self._within_limits(piece.text)
        self.text += text
        self.last = piece
        ids = [entry.token_id for entry in piece.logprobs]
        self.tokens += ids
        probabilities = [self._probability(entry) for entry in piece.logprobs] if self.asked.n_probs else []
        self.probabilities += probabilities
        if piece.finished or self.limited:
            last = {**self.whole(), "content": text, "tokens": ids} | self._probabilities(probabilities)
            return self.fields(last)
        if not text and not ids:
            return None
        event = {"index": 0, "content": text, "tokens": ids, "stop": False, "id_slot": 0}
        return event | self._counts() | self._probabilities(probabilities)

    def until_ended(self, pieces: Iterator[tuple[int, Piece]]) -> Iterator[tuple[int, Piece]]:
        """The pieces up to the one that ends the answer: its last, or the one a limit ends it at (the
        request's row is freed when the route closes its choices)."""
        for item in pieces:
            yield item
            if self.limited:
                return

    def fields(self, answer: dict[str, Any]) -> dict[str, Any]:
        """llama-server's `response_fields`: only the fields at these paths ("timings/prompt_n"), each
        keyed by its path; the answer whole without them."""
        if not self.asked.response_fields:
            return answer
        picked = {}
        for path in self.asked.response_fields:
            value: Any = answer
            for key in path.split("/"):
                value = value.get(key, MISSING) if isinstance(value, dict) else MISSING
            if value is not MISSING:
                picked[path] = value
        return picked

    def _within_limits(self, text: str) -> str:
        """The piece's text that the answer keeps: with n_indent, none after a line (not the first) that
        begins with less indentation, that line's indentation kept (llama-server's cut); with
        t_max_predict_ms, all of it, and the answer ends here if it has a line break by then."""
        if self.asked.n_indent:
            cut = short_indent(self.text + text, self.asked.n_indent, max(0, self.text.rfind("\n")))
            if cut is not None:
                self.limited = True
                return text[: cut - len(self.text)]
        limit = self.asked.t_max_predict_ms
        if limit and "\n" in self.text + text and time.perf_counter() - self.first_piece > limit / 1000:
            self.limited = True
        return text

    def whole(self) -> dict[str, Any]:
        last, params = self.last, self.asked.params
        predicted_ms = 1000 * (time.perf_counter() - self.first_piece)
        prompt_ms = 1000 * (self.first_piece - self.started)
        answer = {
            "index": 0,
            "content": self.text,
            "tokens": self.tokens if self.asked.return_tokens else [],
            "id_slot": 0,
            "stop": True,
            "model": self.serving.model_name,
            **self._counts(),
            "tokens_cached": last.cached_tokens,
            "generation_settings": {
                "n_ctx": self.serving.backend.max_seq_len,
                "n_predict": params.max_tokens,
                "seed": -1 if params.seed is None else params.seed,
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
                "min_p": params.min_p,
                "repeat_penalty": params.repetition_penalty,
                "presence_penalty": params.presence_penalty,
                "frequency_penalty": params.frequency_penalty,
                "stop": list(params.stop),
                "ignore_eos": params.ignore_eos,
                "n_probs": self.asked.n_probs,
            },
            "prompt": self.serving.tokenizer.decode(self.asked.prompt_ids, skip_special_tokens=False),
            "has_new_line": "\n" in self.text,
            "truncated": False,  # a prompt and answer that would not fit are a 400, never cut
            "stop_type": self._stop_type(),
            "stopping_word": last.stop_sequence or "",
            "timings": _timings(
                last.prompt_tokens - last.cached_tokens, prompt_ms, last.completion_tokens, predicted_ms
            ),
        }
        return answer | self._probabilities(self.probabilities)

    def _counts(self) -> dict[str, int]:
        return {"tokens_predicted": self.last.completion_tokens, "tokens_evaluated": self.last.prompt_tokens}

    def _stop_type(self) -> str:
        if self.last.finish_reason == "length" or self.limited:
            return "limit"
        return "word" if self.last.stop_sequence is not None else "eos"

    def _probabilities(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {"completion_probabilities": entries} if self.asked.n_probs else {}

    def _probability(self, entry: TokenLogprob) -> dict[str, Any]:
        """A token as llama-server lists one with `n_probs`: its logprob, and the most likely in its place."""
        top = [self._token(token_id, logprob) for token_id, logprob in entry.top[: self.asked.n_probs]]
        return {**self._token(entry.token_id, entry.logprob), "top_logprobs": top}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        tokenizer = self.serving.tokenizer
        text, token_bytes = tokenizer.token_text(token_id), list(tokenizer.token_bytes(token_id))
        return {"id": token_id, "token": text, "logprob": logprob, "bytes": token_bytes}


def _timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, float]:
    """llama-server's timings: each phase's tokens, its time, and both ways of dividing them."""
    return {
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


def short_indent(text: str, n_indent: int, start: int = 0) -> int | None:
    """Where the text of the first line after `text`'s first that has fewer than `n_indent` spaces or tabs
    before it begins (looking from the line break at or after `start`), else None; a line of nothing but
    spaces and tabs so far is not judged yet. A blank line is indented by none."""
    line_break = text.find("\n", start)
    while line_break != -1:
        begins = line_break + 1
        at = begins
        while at < len(text) and text[at] in " \t":
            at += 1
        if at == len(text):
            return None
        if at - begins < n_indent:
            return at
        line_break = text.find("\n", begins)
    return None
