"""What a request costs against its team's concurrent_streams (proxy/stream_cost.py)."""

import json

import pytest

from proxy.stream_cost import streams_of


@pytest.mark.parametrize(
    "path, body, streams",
    [
        ("/v1/completions", {"prompt": "one", "n": 3}, 3),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, 6),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 1),  # token ids: one prompt
        ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 4}, 8),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5}, 5),
        ("/v1/chat/completions", {"prompt": ["a", "b"]}, 1),  # chat has no prompt list
        ("/v1/completions", {"prompt": ["a", "b"], "n": "4"}, 2),  # not an integer: the server's 400
        ("/v1/completions", {"prompt": ["a", "b"], "n": True}, 2),
        ("/v1/openai/v1/completions", {"prompt": ["a", "b"], "n": 3}, 6),  # Llama Stack's client's routes
        ("/v1/openai/v1/chat/completions", {"messages": [], "n": 7}, 7),
        ("/v1/messages", {"messages": [], "n": 9}, 1),  # no fan-out on other APIs
        ("/predictions/model", {"text": "x"}, 1),
    ],
)
def test_streams_are_prompts_times_n(path, body, streams):
    assert streams_of(path, json.dumps(body).encode()) == streams


@pytest.mark.parametrize("body", [b"", b"not json", b"\xff\xfe", b"[1, 2]", b"null", b"[" * 100_000])
def test_a_body_the_server_would_refuse_counts_one(body):
    assert streams_of("/v1/completions", body) == 1
