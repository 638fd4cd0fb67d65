"""Text Generation Inference's API, for its clients (huggingface_hub's InferenceClient.text_generation,
LangChain's HuggingFaceEndpoint, the `text-generation` client):

    POST /generate          {"inputs", "parameters"}  ->  {"generated_text", "details"?}
    POST /generate_stream   ->  data: {"index", "token", "top_tokens", "generated_text", "details"} a token
    POST /                  either, by the body's `stream`; whole, the answer in a list (as TGI's)
    GET  /info              the model and the limits, as TGI's router describes them

Each streamed event is one token (`{"id", "text", "logprob", "special"}`); the last carries the whole
`generated_text` and, with `details`, why it ended (`eos_token`, `stop_sequence` or `length`). A
token's text is the text it released: a token inside a character, or one whose text a stop string
held back, has "" and a later one the text, so that the tokens' texts make the generated text. With
`details` the whole answer lists its tokens so, `prefill` the input's with `decoder_input_details`,
and `top_tokens` the most likely tokens at each position with `top_n_tokens`. Errors are TGI's
`{"error", "error_type"}` (errors.py), mid-stream a `data:` event of the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, current_app, jsonify

from backend.messages import Piece
from inference_api.apis.tgi.request import (
    MAX_STOP_SEQUENCES,
    MAX_TOP_N_TOKENS,
    TgiRequest,
    parse_generate_request,
)
from inference_api.generation import (
    NO_EVENT,
    ApiFields,
    check_model,
    event_stream,
    read_all,
    read_request,
    serving_now,
    sse_event,
    start_choices,
)
from inference_api.router import Serving

bp = Blueprint("tgi_api", __name__)

FIELDS = ApiFields(
    prompt_ids="inputs", grammar="parameters.grammar", stop_token_ids="parameters.stop", count="inputs"
)


@bp.post("/generate")
def generate() -> Response:
    return _answer(stream=False)


@bp.post("/generate_stream")
def generate_stream() -> Response:
    return _answer(stream=True)


@bp.post("/")
def compat_generate() -> Response:
    return _answer(stream=None)


@bp.get("/info")
def info() -> Response:
    serving = serving_now()
    backend = serving.backend
    return jsonify(
        model_id=serving.model_name,
        model_sha=None,
        model_dtype=backend.dtype,
        model_device_type=backend.device,
        model_pipeline_tag="text-generation",
        max_concurrent_requests=backend.rows + current_app.extensions["router"].max_queue,
        max_best_of=1,
        max_stop_sequences=MAX_STOP_SEQUENCES,
        max_top_n_tokens=MAX_TOP_N_TOKENS,
        max_input_tokens=backend.max_seq_len - 1,
        max_total_tokens=backend.max_seq_len,
        validation_workers=1,
        max_client_batch_size=1,
        router="text-generation-router",
        version=None,
        sha=None,
        docker_label=None,
    )


def _answer(stream: bool | None) -> Response:
    """`stream` None: as the body says, and a whole answer in a list (TGI's `/`)."""
    data, serving = read_request(model_field=None)
    parameters = data.get("parameters")
    if isinstance(parameters, dict) and parameters.get("adapter_id") is not None:
        check_model(parameters, serving, "adapter_id")  # a LoRA adapter's name, or the model's
    asked = parse_generate_request(data, serving, stream)
    choices, pieces = start_choices([(asked.prompt_ids, asked.params)], fields=FIELDS)
    answer = Answer(asked, serving)
    if asked.stream:
        return event_stream(_events(answer, pieces), choices.close, choices.waiting)
    read_all(choices, pieces, FIELDS, answer.read)
    return jsonify([answer.whole()] if stream is None else answer.whole())


def _events(answer: Answer, pieces: Iterator[tuple[int, Piece]]) -> Iterator[bytes]:
    for _, piece in pieces:
        if piece.finish_reason == "error":
            yield sse_event({"error": piece.error, "error_type": "generation"})
            return
        events = answer.read(piece)
        for event in events:
            yield sse_event(event)
        if not events:
            yield NO_EVENT  # (coalesced: what it holds may go out before the next piece is awaited)


class Answer:
    """One request's answer as it comes: `read` each piece (its stream events), then `whole()`."""

    def __init__(self, asked: TgiRequest, serving: Serving):
        self.asked = asked
        self.tokenizer = serving.tokenizer
        self.text = ""
        self.tokens: list[dict[str, Any]] = []
        self.top_tokens: list[list[dict[str, Any]]] = []
        self.prefill: list[dict[str, Any]] = []
        self.last: Piece | None = None

    def read(self, piece: Piece) -> list[dict[str, Any]]:
        """The piece's stream events: one a token, the piece's text with its last token's."""
        if piece.prompt_logprobs is not None:
            self.prefill = [
                self._token(token_id, entry and entry.logprob)
                for token_id, entry in zip(self.asked.prompt_ids, piece.prompt_logprobs, strict=True)
            ]
        self.text += piece.text
        self.last = piece
        # The mock backend scores nothing: its pieces come as tokens of no id and no logprob.
        entries = piece.logprobs or ((None,) if piece.text or piece.finished else ())
        events = []
        for i, entry in enumerate(entries):
            text = piece.text if i == len(entries) - 1 else ""
            token = self._token(entry and entry.token_id, entry and entry.logprob, text)
            top = [self._token(token_id, logprob) for token_id, logprob in (entry.top if entry else ())]
            self.tokens.append(token)
            self.top_tokens.append(top)
            event = {"index": len(self.tokens), "token": token, "top_tokens": top}
            events.append(event | {"generated_text": None, "details": None})
        if piece.finished and events:
            events[-1] |= {"generated_text": self.generated_text, "details": self.stream_details}
        return events

    @property
    def generated_text(self) -> str:
        return self.asked.inputs + self.text if self.asked.return_full_text else self.text

    @property
    def finish_reason(self) -> str:
        if self.last.finish_reason == "length":
            return "length"
        return "stop_sequence" if self.last.stop_sequence is not None else "eos_token"

    @property
    def stream_details(self) -> dict[str, Any] | None:
        if not self.asked.details:
            return None
        return {
            "finish_reason": self.finish_reason,
            "generated_tokens": self.last.completion_tokens,
            "seed": self.asked.params.seed,
            "input_length": len(self.asked.prompt_ids),
        }

    def whole(self) -> dict[str, Any]:
        if not self.asked.details:
            return {"generated_text": self.generated_text}
        details = {
            "finish_reason": self.finish_reason,
            "generated_tokens": self.last.completion_tokens,
            "seed": self.asked.params.seed,
            "prefill": self.prefill,
            "tokens": self.tokens,
            "best_of_sequences": None,
        }
        if self.asked.top_n_tokens:
            details["top_tokens"] = self.top_tokens
        return {"generated_text": self.generated_text, "details": details}

    def _token(self, token_id: int | None, logprob: float | None, text: str | None = None) -> dict[str, Any]:
        """A token as TGI writes one, its text its own unless given (`logprob` None: the input's first,
        which nothing predicts; `token_id` None: the mock's)."""
        written = "" if token_id is None else self.tokenizer.token_text(token_id)
        return {
            "id": token_id,
            "text": written if text is None else text,
            "logprob": logprob,
            "special": token_id is not None and self.tokenizer.special_token_id(written) == token_id,
        }
