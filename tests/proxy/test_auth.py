"""Only HS256 tokens signed with JWT_SECRET and naming a team and a token get through (SPEC §6)."""

import time

import jwt
import pytest
import requests

from proxy.auth import needs_token
from tests.proxy.conftest import SECRET, bearer, token

PROMPT = {"text": "hello", "max_tokens": 3, "stream": False}

BAD_AUTHORIZATION = {
    "no header": None,
    "not bearer": "Basic dXNlcjpwYXNz",
    "bearer without token": "Bearer ",
    "garbage": "Bearer not.a.jwt",
    "wrong signature": f"Bearer {token(secret='another-secret-' + 'y' * 40)}",
    "expired": f"Bearer {token(exp=int(time.time()) - 60)}",
    "alg none": "Bearer " + jwt.encode({"team_id": "team-a", "token_id": "tok-1"}, None, algorithm="none"),
    "another algorithm": f"Bearer {token(algorithm='HS512')}",
    "no team_id": "Bearer " + jwt.encode({"token_id": "tok-1"}, SECRET, algorithm="HS256"),
    "no token_id": "Bearer " + jwt.encode({"team_id": "team-a"}, SECRET, algorithm="HS256"),
}


@pytest.mark.parametrize("case", list(BAD_AUTHORIZATION))
def test_a_bad_token_is_a_401_with_a_json_error(proxy, case):
    authorization = BAD_AUTHORIZATION[case]
    headers = {"Authorization": authorization} if authorization else {}
    response = requests.post(f"{proxy.url}/predictions/mock", json=PROMPT, headers=headers, timeout=10)
    assert response.status_code == 401
    assert response.headers["Content-Type"] == "application/json"
    assert response.json()["status_code"] == 401 and response.json()["message"]
    assert response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "claims, message",
    [
        ({"exp": int(time.time()) - 60}, "the token has expired"),
        ({"nbf": int(time.time()) + 3600}, "the token is not valid yet"),
        ({"iat": "yesterday"}, "the token is malformed"),
    ],
)
def test_the_401_says_what_is_wrong_with_the_token(proxy, claims, message):
    response = requests.get(f"{proxy.url}/v1/models", headers=bearer(token(**claims)), timeout=10)
    assert response.status_code == 401 and message in response.json()["message"]


def test_tokens_never_reach_the_log(proxy):
    secret_token = token(token_id="tok-logged")
    requests.post(f"{proxy.url}/predictions/mock", json=PROMPT, headers=bearer(secret_token), timeout=10)
    for value in BAD_AUTHORIZATION.values():
        if value:
            requests.get(f"{proxy.url}/v1/models", headers={"Authorization": value}, timeout=10)
    log = proxy.log()
    assert "team=team-a token=tok-logged" in log
    assert secret_token not in log
    assert all(
        value.split(" ", 1)[-1] not in log
        for value in BAD_AUTHORIZATION.values()
        if value and len(value) > 20
    )


def test_a_valid_token_gets_the_answer(proxy):
    response = requests.post(f"{proxy.url}/predictions/mock", json=PROMPT, headers=bearer(), timeout=10)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_an_unexpired_token_passes(proxy):
    response = requests.post(
        f"{proxy.url}/predictions/mock",
        json=PROMPT,
        headers=bearer(token(exp=int(time.time()) + 60)),
        timeout=10,
    )
    assert response.status_code == 200


def test_loading_or_unloading_an_adapter_is_not_forwarded_whatever_the_token(proxy, mock_server):
    """A team must not load a directory of the server's disk, nor unload another team's adapter: the
    operator calls the inference server itself, which answers only with --allow-runtime-lora."""
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "//v1/load_lora_adapter/"):
        refused = requests.post(f"{proxy.url}{path}", json=body, headers=bearer(), timeout=10)
        assert refused.status_code == 403 and "the operator's" in refused.json()["message"], path
        assert requests.post(f"{proxy.url}{path}", json=body, timeout=10).status_code == 401
    direct = requests.post(f"{mock_server.url}/v1/load_lora_adapter", json=body, timeout=10)
    assert direct.status_code == 404 and "--allow-runtime-lora" in direct.json()["error"]["message"]


def test_health_needs_no_token(proxy):
    assert requests.get(f"{proxy.url}/health", timeout=10).status_code == 200


# The chat page loads before anyone can type a token into it (SPEC §4.4); the rest is the API.
PUBLIC = [("GET", "/"), ("HEAD", "/"), ("GET", "/openapi.json"), ("GET", "/static/chat.js")]
PROTECTED = [
    ("POST", "/"),
    ("POST", "/openapi.json"),
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/predictions/mock"),
    ("POST", "/generate"),
    ("GET", "/info"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/static/../v1/models"),
    ("GET", "/static/sub/chat.js"),
    ("GET", "/static/.hidden"),
    ("GET", "/static/"),
    ("GET", "//"),
    ("GET", "/index.html"),
]


@pytest.mark.parametrize("method, path", PUBLIC + PROTECTED)
def test_only_the_page_its_files_and_the_api_description_are_public(method, path):
    assert needs_token(method, path) == ((method, path) not in PUBLIC)


def test_the_page_loads_through_the_proxy_without_a_token(proxy):
    for path in ("/", "/static/chat.js", "/static/chat.css", "/openapi.json"):
        response = requests.get(f"{proxy.url}{path}", timeout=10)
        assert response.status_code == 200, path
    assert requests.get(f"{proxy.url}/static/missing.js", timeout=10).status_code == 404
    assert requests.get(f"{proxy.url}/v1/models", timeout=10).status_code == 401
    assert requests.post(f"{proxy.url}/", timeout=10).status_code == 401


def test_the_openai_client_passes_its_api_key_as_the_bearer_token(proxy):
    import openai

    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=token(), max_retries=0)
    stream = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    assert len("".join(c.choices[0].delta.content or "" for c in stream).split()) == 5
    refused = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.models.list()


def test_the_token_may_come_alone_as_x_api_key_as_anthropic_clients_send_it(proxy):
    import anthropic

    client = anthropic.Anthropic(base_url=proxy.url, api_key=token(), max_retries=0)
    with client.messages.stream(
        model="mock", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
    assert len(text.split()) == 5
    refused = anthropic.Anthropic(base_url=proxy.url, api_key="not-a-token", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        refused.messages.create(model="mock", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


# The bad Bearer tokens, alone: each is as bad in x-api-key.
BAD_KEYS = {
    case: value.removeprefix("Bearer ")
    for case, value in BAD_AUTHORIZATION.items()
    if value and value.startswith("Bearer ") and value.strip() != "Bearer"
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_a_bad_token_in_x_api_key_is_a_401_too(proxy, case):
    headers = {"x-api-key": BAD_KEYS[case]}
    response = requests.post(f"{proxy.url}/predictions/mock", json=PROMPT, headers=headers, timeout=10)
    assert response.status_code == 401 and response.json()["status_code"] == 401


def test_authorization_is_the_header_read_when_both_come(proxy):
    both = {"Authorization": "Bearer not.a.jwt", "x-api-key": token()}
    assert (
        requests.post(f"{proxy.url}/predictions/mock", json=PROMPT, headers=both, timeout=10).status_code
        == 401
    )
    both = {**bearer(), "x-api-key": "not.a.jwt"}
    assert (
        requests.post(f"{proxy.url}/predictions/mock", json=PROMPT, headers=both, timeout=10).status_code
        == 200
    )
