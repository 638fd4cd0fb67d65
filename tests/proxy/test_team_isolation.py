"""Teams on one server learn nothing of each other's prompts (SPEC §6; issue 35, item 1): the cached-prefix
side channel, tried as an attacker would, through the real proxy in front of a real server on the default
model.

Team A's prompt holds a secret. Team B sends the same text with a guessed secret: were prefixes shared
across teams, a right guess would come back with its prompt all but one token cached (and a first token
several times sooner), a wrong one with a few tokens, and the count grows token by token, so that a
secret could be read out a token at a time.
"""

from __future__ import annotations

import json
import random
import string

import pytest
import requests

from tests.proxy.conftest import bearer, running_proxy, token
from tests.server_fixture import RunningServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"

SECRET_MEMO = (
    "You are the internal assistant of ACME Corp. Confidential memo: the merger code name is BLUEHERON. "
    "Do not disclose. "
)


@pytest.fixture(scope="module")
def server(default_mode_server: RunningServer) -> RunningServer:
    return default_mode_server


@pytest.fixture(scope="module")
def proxy(server):
    with running_proxy(server.url) as running:
        yield running


def cached_tokens(proxy, team: str, prompt: str, **fields) -> tuple[int, int]:
    """A streamed completion of one token as the attack sends it: (prompt tokens, cached tokens)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        **fields,
    }
    headers = bearer(token(team_id=team, token_id=f"{team}-laptop"))
    response = requests.post(
        f"{proxy.url}/v1/completions", json=body, headers=headers, stream=True, timeout=120
    )
    assert response.status_code == 200, response.text
    usage = None
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            usage = json.loads(line[len(b"data: ") :]).get("usage") or usage
    assert usage is not None, "no usage chunk"
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_another_team_sending_the_same_secret_reuses_nothing_while_the_team_itself_does(proxy, server):
    prompt = SECRET_MEMO + "".join(random.Random(35).choices(string.ascii_letters + " ", k=200))
    prompt_tokens, first = cached_tokens(proxy, "acme", prompt)
    assert first == 0
    assert cached_tokens(proxy, "acme", prompt) == (prompt_tokens, prompt_tokens - 1)  # its own next turn
    before = server.metric("inference_prompt_tokens_cached_total")

    # The row that holds acme's prompt is the lowest free one: each guess is placed there.
    right_guess = cached_tokens(proxy, "rival", prompt)
    wrong_guess = cached_tokens(proxy, "other-rival", prompt.replace("BLUEHERON", "REDFALCON"))
    assert right_guess == (prompt_tokens, 0) and wrong_guess[1] == 0  # the same: nothing to tell apart
    assert server.metric("inference_prompt_tokens_cached_total") == before  # nor does /metrics tell


def test_a_cache_salt_narrows_sharing_within_a_team(proxy):
    prompt = "Salted: " + "".join(random.Random(36).choices(string.ascii_letters + " ", k=300))
    prompt_tokens, first = cached_tokens(proxy, "acme", prompt, cache_salt="s3cr3t-salt-of-alice")
    assert first == 0
    assert cached_tokens(proxy, "acme", prompt, cache_salt="s3cr3t-salt-of-alice")[1] == prompt_tokens - 1
    assert cached_tokens(proxy, "acme", prompt)[1] == 0  # the team, without the salt
    assert cached_tokens(proxy, "acme", prompt, cache_salt="another-salt")[1] == 0


def test_a_client_cannot_claim_another_team_by_its_own_header(proxy):
    """The proxy drops a client's X-Team-ID and sends the token's: a rival naming acme in a header gets
    the rival's scope, not acme's prefixes."""
    prompt = "Header: " + "".join(random.Random(37).choices(string.ascii_letters + " ", k=300))
    cached_tokens(proxy, "acme", prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    headers = {**bearer(token(team_id="rival", token_id="rival-laptop")), "X-Team-ID": "acme"}
    answer = requests.post(f"{proxy.url}/v1/completions", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_empty_cache_salt_is_a_400_naming_it(proxy):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "cache_salt": ""}
    answer = requests.post(f"{proxy.url}/v1/completions", json=body, headers=bearer(), timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "cache_salt"
