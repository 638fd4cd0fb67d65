"""The app's JSON writer: json.dumps' text to the byte, a long list written an element a call."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from flask import Flask

from inference_api.json_answers import (
    LONG_LIST,
    OBJECTS_A_CALL,
    SLICE,
    PiecewiseJSONProvider,
    dumps_in_pieces,
)


class RecordingEncoder(json.JSONEncoder):
    """Each text one call wrote, to see how big the longest write under the GIL was."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.written: list[str] = []

    def encode(self, o):
        text = super().encode(o)
        self.written.append(text)
        return text


def prompt_logprobs_answer(positions: int, alternatives: int) -> dict:
    """A completion answer shaped as vLLM's prompt_logprobs, ids and numbers random."""
    rng = random.Random(positions)

    def score(rank: int) -> dict:
        return {"logprob": -rng.random() * 9, "rank": rank, "decoded_token": f" tök{rng.randrange(49_152)}"}

    prompt = [None] + [
        {str(rng.randrange(49_152)): score(rank) for rank in range(1, alternatives + 2)}
        for _ in range(positions - 1)
    ]
    choice = {"index": 0, "text": "ok", "prompt_logprobs": prompt, "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": {"prompt_tokens": 9}}


@dataclasses.dataclass
class Point:
    x: int
    y: float


VALUES = [
    {},
    [],
    "plain",
    1.5,
    None,
    {"b": 1, "a": [1, 2, 3], "c": {"z": None, "y": True}},
    {"long": list(range(500)), "nested": [[i, str(i)] for i in range(200)], "é": "ü\u2028\n"},
    [{"deep": [{"deeper": [list(range(100))]}]}] * 3,
    {"tuples": tuple((i, -i / 3) for i in range(300)), "floats": [math.inf, -math.inf, math.nan] * 30},
    {"point": Point(1, 2.5), "points": [Point(i, i / 2) for i in range(100)]},  # through Flask's default
    {1: "int key", 2: [0] * 100},  # keys that are not strings: the object goes to C whole
    [[[[[[[[list(range(70))]]]]]]]],  # deeper than the walk looks
    {"data": [{"embedding": [i / 7 for i in range(2_500)], "index": i} for i in range(3)]},  # in slices
    prompt_logprobs_answer(300, 5),
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
@pytest.mark.parametrize("flask_args", [{"separators": (",", ":")}, {}], ids=["response", "dumps"])
def test_the_text_is_json_dumps_own_with_flasks_defaults(value, flask_args):
    app = Flask(__name__)
    expected = json.dumps(value, default=app.json.default, ensure_ascii=True, sort_keys=True, **flask_args)
    assert PiecewiseJSONProvider(app).dumps(value, **flask_args) == expected
    kwargs = dict(default=app.json.default, ensure_ascii=False, sort_keys=False, **flask_args)
    assert dumps_in_pieces(value, json.JSONEncoder(**kwargs)) == json.dumps(value, **kwargs)


def test_a_big_answers_longest_single_write_is_a_position_of_it():
    answer = prompt_logprobs_answer(1_900, 20)
    encoder = RecordingEncoder(ensure_ascii=True, sort_keys=True, separators=(",", ":"))
    text = dumps_in_pieces(answer, encoder)
    assert text == json.dumps(answer, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
    assert len(text) > 1_000_000
    # Each write is 8 positions' 21 scores (about 1.4 KB a position), never the list of them.
    assert max(len(piece) for piece in encoder.written) < OBJECTS_A_CALL * 2_000
    assert len(encoder.written) >= 1_900 / OBJECTS_A_CALL


def test_a_long_list_of_numbers_is_written_a_slice_a_call():
    embedding = [i / 7 for i in range(2 * SLICE + 1)]
    encoder = RecordingEncoder()
    assert dumps_in_pieces(embedding, encoder) == json.dumps(embedding)
    assert len(encoder.written) == 3  # not a number a call: a call's own cost is a number's writing


def test_a_short_answer_is_written_in_a_few_calls():
    encoder = RecordingEncoder(sort_keys=True)
    dumps_in_pieces({"tokens": list(range(LONG_LIST)), "count": LONG_LIST}, encoder)
    assert encoder.written == ['"count"', str(LONG_LIST), '"tokens"', json.dumps(list(range(LONG_LIST)))]


def test_the_apps_answers_are_written_by_it(app):
    assert isinstance(app.json, PiecewiseJSONProvider)
    response = app.test_client().post("/tokenize", json={"prompt": "word " * 300})
    assert response.status_code == 200
    tokens = response.get_json()["tokens"]
    assert len(tokens) > LONG_LIST
    assert (
        response.get_data(as_text=True)
        == json.dumps(response.get_json(), sort_keys=True, separators=(",", ":")) + "\n"
    )


def test_debug_modes_pretty_answers_are_json_dumps_whole():
    app = Flask(__name__)
    value = {"b": list(range(100)), "a": "x"}
    expected = json.dumps(value, default=app.json.default, ensure_ascii=True, sort_keys=True, indent=2)
    assert PiecewiseJSONProvider(app).dumps(value, indent=2) == expected
