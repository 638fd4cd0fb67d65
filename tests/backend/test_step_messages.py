"""A step's pieces cross the pipe from the backend to the router whole (StepOutput's own pickling)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle

from backend.messages import Piece, StepOutput, TokenLogprob


def every_field_set(request_id: str) -> Piece:
    """A piece whose every field differs from its default, each from the others."""
    return Piece(
        request_id,
        "text",
        "error",
        prompt_tokens=3,
        completion_tokens=4,
        error="bad",
        logprobs=(TokenLogprob(5, -0.25, ((5, -0.25), (6, -1.5)), 1),),
        prompt_logprobs=(None, TokenLogprob(7, -2.0)),
        token_ids=(8, 9),
        cached_tokens=10,
        queued_seconds=0.5,
        stop_sequence="END",
        stop_token_id=11,
        embedding=(0.125, -0.5),
        invalid="prompt_ids",
        draft_tokens=12,
        accepted_draft_tokens=13,
        predicted_tokens=14,
        accepted_predicted_tokens=15,
    )


def test_every_field_of_every_piece_and_the_admitted_ids_cross_a_pipe() -> None:
    sent = StepOutput([every_field_set("a"), Piece("b", "x"), every_field_set("c")], admitted=["d", "e"])
    defaults = {field.name: field.default for field in dataclasses.fields(Piece)}
    assert all(getattr(sent.pieces[0], name) != value for name, value in defaults.items() if name != "text")
    receiving, sending = multiprocessing.Pipe(duplex=False)
    sending.send(sent)
    received = receiving.recv()
    assert received == sent and [type(piece) for piece in received.pieces] == [Piece] * 3
    assert received.pieces[1].finished is False and received.pieces[0].finished is True
    assert dataclasses.replace(received.pieces[1], text="y").text == "y"  # a dataclass as made by __init__


def test_an_empty_step_a_heartbeat_crosses_as_itself() -> None:
    assert pickle.loads(pickle.dumps(StepOutput([]))) == StepOutput([], [])
