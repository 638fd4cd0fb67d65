"""Events made while more pieces are already queued go out as one write (generation.coalesced), and none
is held while the request thread could wait for the next piece."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator

import pytest
from flask import Flask

from backend.messages import Piece
from backend.mock import mock_text
from inference_api import generation
from inference_api.apis.llamacpp import routes as llamacpp_routes
from inference_api.apis.openai import routes
from inference_api.apis.tgi import routes as tgi_routes
from inference_api.generation import NO_EVENT, coalesced


def events_from(pieces: queue.Queue[str | None]) -> Iterator[bytes]:
    """An event a piece, NO_EVENT for a piece of no text, until None. Waiting on an empty queue raises
    queue.Empty after a second: a test whose events are held meanwhile fails instead of hanging."""
    while (piece := pieces.get(timeout=1)) is not None:
        yield f"data: {piece}\n\n".encode() if piece else NO_EVENT


def queued(*pieces: str | None) -> queue.Queue[str | None]:
    waiting: queue.Queue[str | None] = queue.Queue()
    for piece in pieces:
        waiting.put(piece)
    return waiting


def test_events_of_pieces_already_waiting_go_out_as_one_write_and_each_later_one_alone() -> None:
    pieces = queued("a", "b", "c")
    writes = coalesced(events_from(pieces), lambda: not pieces.empty())
    assert next(writes) == b"data: a\n\ndata: b\n\ndata: c\n\n"
    pieces.put("d")
    assert next(writes) == b"data: d\n\n"
    pieces.put(None)
    assert list(writes) == []


def test_a_piece_of_no_event_lets_the_held_ones_out_before_the_next_piece_is_awaited() -> None:
    """The event of "a" is held while "" waits; "" makes no event and nothing waits after it: "a" goes
    out then, not after the next piece (a stop string's held-back text, or a tool call's, can last many
    steps)."""
    pieces = queued("a", "")
    writes = coalesced(events_from(pieces), lambda: not pieces.empty())
    assert next(writes) == b"data: a\n\n"  # (held until a third piece, it would raise queue.Empty)
    pieces.put("b")
    pieces.put(None)
    assert list(writes) == [b"data: b\n\n"]


def test_events_held_when_the_events_fail_go_out_before_the_failure() -> None:
    """The native API ends a stream that fails mid-way by raising (gunicorn cuts the connection): the
    text made before the failure is still written first."""

    def events() -> Iterator[bytes]:
        yield b"a"
        raise RuntimeError("generation failed mid-stream")

    writes = coalesced(events(), lambda: True)  # (the failing piece was already waiting)
    assert next(writes) == b"a"
    with pytest.raises(RuntimeError, match="mid-stream"):
        next(writes)


def test_closing_the_writes_closes_the_events_so_that_their_requests_end() -> None:
    ended = []

    def events() -> Iterator[bytes]:
        try:
            yield b"data: a\n\n"
            yield b"data: b\n\n"
        finally:
            ended.append(True)

    made = events()  # (held here, so that no garbage collection closes it instead)
    writes = coalesced(made, lambda: False)
    assert next(writes) == b"data: a\n\n"
    writes.close()  # a client gone after the first write
    assert ended == [True]


def texts(writes: list[bytes]) -> list[str]:
    events = b"".join(writes).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    return [json.loads(event.removeprefix("data: "))["choices"][0]["text"] for event in events[:-2]]


def test_a_reader_behind_the_steps_gets_the_waiting_events_in_fewer_writes_and_the_same_text(
    app: Flask,
) -> None:
    body = {"model": "mock", "prompt": "same", "max_tokens": 40, "stream": True}
    prompt_ids = tuple(b"same")  # (the mock model's tokens are the text's bytes)
    response = app.test_client().post("/v1/completions", json=body, buffered=False)
    writes = iter(response.response)
    first = next(writes)
    time.sleep(0.3)  # the mock makes 1,000 tokens a second: the others wait in the queue by now
    rest = list(writes)
    response.close()
    events = texts([first, *rest])
    assert "".join(events) == mock_text(prompt_ids, 40)
    # (the first write may carry a few events already: those that waited when it was made)
    assert len(events) == 40 and len(rest) < 10, [write.count(b"data: ") for write in [first, *rest]]


def test_the_native_stream_of_a_reader_behind_the_steps_comes_in_fewer_writes_and_the_same_text(
    app: Flask,
) -> None:
    response = app.test_client().post(
        "/predictions/mock", json={"text": "same", "max_tokens": 40}, buffered=False
    )
    writes = iter(response.response)
    first = next(writes)
    time.sleep(0.3)
    rest = list(writes)
    response.close()
    assert b"".join([first, *rest]).decode() == mock_text(tuple(b"same"), 40)
    assert len(rest) < 10, rest


class HeldBackChoices:
    """One request's choices whose second piece, there already when the first one's events are made,
    makes no text (held back: it may begin a stop string); `awaited_third` once the third is asked for."""

    streams = [None]
    prompt_tokens, completion_tokens, cached_tokens = 4, 3, 0

    def __init__(self) -> None:
        self.queued = 1
        self.awaited_third = False

    def waiting(self) -> bool:
        return self.queued > 0

    def close(self) -> None:
        pass

    def pieces(self) -> Iterator[tuple[int, Piece]]:
        yield 0, Piece("r", "Hello", completion_tokens=1)
        self.queued = 0
        yield 0, Piece("r", "", completion_tokens=2)
        self.awaited_third = True
        yield 0, Piece("r", " world", "length", completion_tokens=3)


def test_an_openai_stream_lets_its_events_out_at_a_piece_of_no_text(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route's events mark a piece that makes no event (here text held back at a stop string's
    start), so that the event before it goes out before the next piece is awaited."""
    choices = HeldBackChoices()
    monkeypatch.setattr(routes, "start_choices", lambda *args, **kwargs: (choices, choices.pieces()))
    body = {"model": "mock", "prompt": "hi", "max_tokens": 3, "stream": True}
    response = app.test_client().post("/v1/completions", json=body, buffered=False)
    writes = iter(response.response)
    assert texts([next(writes), b"data: [DONE]\n\n"]) == ["Hello"]
    assert not choices.awaited_third  # the first write went out before the third piece was asked for
    assert texts(list(writes)) == [" world"]
    response.close()


def json_events(body: bytes) -> list[dict]:
    """The JSON objects of a stream: server-sent events' data lines, or NDJSON's lines."""
    lines = (line.removeprefix("data:").strip() for line in body.decode().splitlines())
    return [json.loads(line) for line in lines if line.startswith("{")]


STREAMS = {  # each API's streaming request for 40 tokens, and the text of one of its events
    "anthropic": (
        "/v1/messages",
        {
            "model": "mock",
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "same"}],
            "stream": True,
        },
        lambda event: event["delta"]["text"] if event["type"] == "content_block_delta" else "",
    ),
    "responses": (
        "/v1/responses",
        {"model": "mock", "input": "same", "max_output_tokens": 40, "stream": True},
        lambda event: event["delta"] if event["type"] == "response.output_text.delta" else "",
    ),
    "llama-stack": (
        "/inference/completion",
        {"model_id": "mock", "content": "same", "sampling_params": {"max_tokens": 40}, "stream": True},
        lambda event: event["delta"],
    ),
    "tgi": (
        "/generate_stream",
        {"inputs": "same", "parameters": {"max_new_tokens": 40}},
        lambda event: event["token"]["text"],
    ),
    "llama.cpp": (
        "/completion",
        {"prompt": "same", "n_predict": 40, "stream": True},
        lambda event: event["content"],
    ),
    "ollama": (
        "/api/generate",
        {"model": "mock", "prompt": "same", "options": {"num_predict": 40}},
        lambda event: event["response"],
    ),
}


@pytest.mark.parametrize("api", STREAMS)
def test_every_streaming_api_writes_the_waiting_events_of_a_reader_behind_the_steps_at_once(
    app: Flask, api: str
) -> None:
    path, body, text_of = STREAMS[api]
    client = app.test_client()
    whole = b"".join(client.post(path, json=body).response)
    response = client.post(path, json=body, buffered=False)
    writes = iter(response.response)
    first = next(writes)
    time.sleep(0.3)  # the mock makes 1,000 tokens a second: the rest wait in the queue by now
    rest = list(writes)
    response.close()
    text = "".join(text_of(event) for event in json_events(b"".join([first, *rest])))
    assert len(text) >= 40 and text == "".join(text_of(event) for event in json_events(whole))
    assert len(rest) < 10, [len(json_events(write)) for write in rest]


@pytest.mark.parametrize("api", STREAMS)
def test_every_streaming_api_lets_its_events_out_at_a_piece_of_no_text(
    app: Flask, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    """As the OpenAI route's test above, for each other API: the piece held back makes no event, and
    the events before it go out before the next piece is awaited."""
    choices = HeldBackChoices()
    for module in (generation, tgi_routes, llamacpp_routes):
        monkeypatch.setattr(module, "start_choices", lambda *args, **kwargs: (choices, choices.pieces()))
    path, body, text_of = STREAMS[api]
    response = app.test_client().post(path, json=body, buffered=False)
    writes = iter(response.response)
    assert "".join(text_of(event) for event in json_events(next(writes))) == "Hello"
    assert not choices.awaited_third  # the first write went out before the third piece was asked for
    assert "".join(text_of(event) for event in json_events(b"".join(writes))) == " world"
    response.close()
