"""Per team (SPEC §6; issue 19, item 8): revoked tokens, limits on requests in flight and per minute, and
usage in /metrics. Through a real proxy process with real tokens, the files edited while it runs."""

from __future__ import annotations

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests

from proxy.limits import Limits, parse_team_limits
from proxy.team_gate import Refused, TeamGate
from tests.proxy.conftest import bearer, running_proxy, start_refused, token
from tests.server_fixture import free_port, running_server


def edit(path: Path, text: str) -> None:
    """Replace the file whole, as an editor's save or a ConfigMap update does (a new inode each time)."""
    scratch = path.with_suffix(".new")
    scratch.write_text(text)
    scratch.replace(path)


def get_models(proxy, **claims) -> requests.Response:
    return requests.get(f"{proxy.url}/v1/models", headers=bearer(token(**claims)), timeout=10)


def metrics(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, by its name and labels as written."""
    page = requests.get(f"{url}/metrics", timeout=10)
    assert page.status_code == 200, page.text
    samples = {}
    for line in page.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def eventually(read, done, seconds: float = 5.0):
    """What `read` returns once `done` holds of it (a count that changes just after an answer ends)."""
    deadline = time.monotonic() + seconds
    while not done(value := read()):
        assert time.monotonic() < deadline, f"still {value}"
        time.sleep(0.05)
    return value


def test_a_token_revoked_while_the_proxy_runs_is_refused_from_the_next_request(echo_upstream, tmp_path):
    revoked = tmp_path / "revoked.txt"
    with running_proxy(echo_upstream.url, args=("--revoked-tokens", str(revoked))) as proxy:
        assert "does not exist: none until it does" in proxy.log()  # the warning at start
        assert get_models(proxy, token_id="laptop").status_code == 200

        edit(revoked, "# lost on the train\nlaptop   # alice, 2026-11-02\n")
        refused = get_models(proxy, token_id="laptop")
        assert refused.status_code == 401
        assert "revoked" in refused.json()["message"]
        assert refused.json()["error"]["type"] == "authentication_error"
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert get_models(proxy, token_id="desktop").status_code == 200  # the same team's other token
        assert get_models(proxy, token_id="laptop#2").status_code == 200  # a comment needs a space before

        revoked.unlink()  # deleted by mistake: the last list stays in force
        assert get_models(proxy, token_id="laptop").status_code == 401
        edit(revoked, "# nothing revoked\n")
        assert get_models(proxy, token_id="laptop").status_code == 200
        assert "401 team=team-a token=laptop GET /v1/models: the token has been revoked" in proxy.log()


def stream(proxy_url: str, team: str, tokens: int = 20) -> requests.Response:
    """A streamed answer of `tokens` tokens (1 s at the mock's 20 a second), its headers read."""
    return requests.post(
        f"{proxy_url}/predictions/mock",
        json={"text": "hi", "max_tokens": tokens, "stream": True},
        headers=bearer(token(team_id=team)),
        stream=True,
        timeout=10,
    )


def test_a_team_past_its_concurrent_streams_gets_429_and_other_teams_go_on(mock_server, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("[teams.small]\nconcurrent_streams = 2\n")
    with running_proxy(mock_server.url, args=("--team-limits", str(limits))) as proxy:
        first, second = stream(proxy.url, "small"), stream(proxy.url, "small")
        assert first.status_code == second.status_code == 200
        third = stream(proxy.url, "small")
        assert third.status_code == 429
        assert third.headers["Retry-After"] == "1"
        assert third.json()["status_code"] == 429 and third.json()["error"]["type"] == "rate_limit_error"
        assert "2 of its 2 streams in flight" in third.json()["message"]
        other = stream(proxy.url, "large")  # no limit of its own, no default: unaffected
        assert other.status_code == 200
        for response in (first, second, other):
            assert len(response.content.split()) == 20  # read whole: the streams end...
        assert stream(proxy.url, "small").status_code == 200  # ...and their places are free again

        # A client that goes away mid-stream frees its place too.
        gone = [stream(proxy.url, "small", tokens=200) for _ in range(2)]
        assert stream(proxy.url, "small").status_code == 429
        for response in gone:
            response.close()
        deadline = time.monotonic() + 5
        while (answer := stream(proxy.url, "small")).status_code == 429:
            assert time.monotonic() < deadline, "the places of the clients that left are still taken"
            time.sleep(0.1)
        assert answer.status_code == 200 and len(answer.content.split()) == 20


def completions(proxy_url: str, team: str, prompts: list[str], n: int) -> requests.Response:
    body = {"model": "mock", "prompt": prompts, "n": n, "max_tokens": 5, "stream": True}
    headers = bearer(token(team_id=team))
    return requests.post(f"{proxy_url}/v1/completions", json=body, headers=headers, stream=True, timeout=30)


def test_a_request_counts_its_prompts_times_n_against_the_teams_streams(mock_server, tmp_path):
    """One request of 6 prompts and n 16 took all 32 rows of a server while its team might hold 2: a
    request takes prompts x n streams of its team's limit, and one that could never fit is a 400."""
    limits = tmp_path / "limits.toml"
    limits.write_text("[teams.small]\nconcurrent_streams = 8\n")
    with running_proxy(mock_server.url, args=("--team-limits", str(limits))) as proxy:
        six = completions(proxy.url, "small", ["a", "b"], 3)
        assert six.status_code == 200
        another_six = completions(proxy.url, "small", ["c", "d"], 3)
        assert another_six.status_code == 429
        assert "6 of its 8 streams in flight and this request takes 6" in another_six.json()["message"]
        two = completions(proxy.url, "small", ["e"], 2)
        assert two.status_code == 200  # 6 + 2: within 8
        flood = completions(proxy.url, "small", ["a", "b", "c", "d", "e", "f"], 16)
        assert flood.status_code == 400 and "Retry-After" not in flood.headers
        assert "takes 96 streams (prompts x n); your team may hold 8" in flood.json()["message"]
        for response in (six, two):
            assert b"[DONE]" in response.content  # read whole: their streams end
        assert completions(proxy.url, "small", ["g", "h"], 4).status_code == 200  # all 8 free again


def test_the_fourth_request_in_a_minute_gets_429_with_the_seconds_to_wait(echo_upstream, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nrequests_per_minute = 3\n")
    with running_proxy(echo_upstream.url, args=("--team-limits", str(limits))) as proxy:
        assert [get_models(proxy, team_id="t1").status_code for _ in range(3)] == [200] * 3
        refused = get_models(proxy, team_id="t1")
        assert refused.status_code == 429
        retry_after = refused.headers["Retry-After"]
        assert re.fullmatch(r"[1-9][0-9]*", retry_after) and int(retry_after) <= 60
        assert "3 requests per minute" in refused.json()["message"]
        assert get_models(proxy, team_id="t2").status_code == 200  # each team its own minute

        # Raised while it runs: the next request sees the new limit.
        edit(limits, '[default]\nrequests_per_minute = 3\n\n[teams.t1]\nrequests_per_minute = "unlimited"\n')
        assert get_models(proxy, team_id="t1").status_code == 200
        # A file that does not parse leaves the limits as they were, and says so.
        edit(limits, "[default]\nrequests_per_minute = 0\n")
        assert get_models(proxy, team_id="t1").status_code == 200
        assert "must be a positive integer" in proxy.log()


def test_metrics_count_each_teams_requests_refusals_and_streams_in_flight(mock_server, tmp_path):
    limits, revoked = tmp_path / "limits.toml", tmp_path / "revoked.txt"
    limits.write_text("[teams.metered]\nrequests_per_minute = 2\n[teams.narrow]\nconcurrent_streams = 1\n")
    revoked.write_text("gone\n")
    probe_port = free_port()
    args = ("--team-limits", str(limits), "--revoked-tokens", str(revoked), "--health-port", str(probe_port))
    probe = f"http://127.0.0.1:{probe_port}"
    with running_proxy(mock_server.url, args=args) as proxy:
        assert [get_models(proxy, team_id="metered").status_code for _ in range(3)] == [200, 200, 429]
        assert get_models(proxy, team_id="metered", token_id="gone").status_code == 401
        assert get_models(proxy, team_id="研究").status_code == 200
        held = stream(proxy.url, "narrow")
        assert stream(proxy.url, "narrow").status_code == 429
        during = metrics(probe)  # no token: the probe port is the cluster's
        assert len(held.content.split()) == 20
        after = eventually(
            lambda: metrics(probe), lambda m: 'proxy_team_requests_in_flight{team="narrow"}' not in m
        )
        upstreams = requests.get(f"{proxy.url}/metrics", headers=bearer(), timeout=10)

    assert during['proxy_team_requests_in_flight{team="narrow"}'] == 1
    assert after['proxy_team_requests_total{status="2xx",team="metered"}'] == 2
    assert after['proxy_team_requests_total{status="4xx",team="metered"}'] == 2  # rate and revoked
    assert after['proxy_team_rejected_total{reason="rate",team="metered"}'] == 1
    assert after['proxy_team_rejected_total{reason="revoked",team="metered"}'] == 1
    assert after['proxy_team_rejected_total{reason="concurrency",team="narrow"}'] == 1
    assert after['proxy_team_requests_total{status="2xx",team="narrow"}'] == 1
    assert after['proxy_team_requests_total{status="2xx",team="%E7%A0%94%E7%A9%B6"}'] == 1  # as X-Team-ID
    # On the traffic port no /metrics: the inference server's would show every team's usage to any token.
    assert upstreams.status_code == 404 and "scrape each inference server directly" in upstreams.text
    assert "inference_" not in upstreams.text and "proxy_team_requests" not in upstreams.text


def test_each_teams_tokens_are_counted_by_the_inference_server_as_its_usage_says(mock_server, proxy):
    def counted(team: str) -> tuple[float, float]:
        samples = metrics(mock_server.url)
        return (
            samples.get(f'inference_team_prompt_tokens_total{{team="{team}"}}', 0.0),
            samples.get(f'inference_team_completion_tokens_total{{team="{team}"}}', 0.0),
        )

    headers = {**bearer(token(team_id="billing")), "X-Team-ID": "forged"}  # the client's claim is dropped
    answer = requests.post(
        f"{proxy.url}/v1/completions",
        json={"model": "mock", "prompt": "one two three", "max_tokens": 7},
        headers=headers,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] and usage["completion_tokens"] == 7
    once = (usage["prompt_tokens"], usage["completion_tokens"])
    eventually(lambda: counted("billing"), lambda seen: seen == once)

    with requests.post(
        f"{proxy.url}/v1/chat/completions",
        json={
            "model": "mock",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers=headers,
        stream=True,
        timeout=30,
    ) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith(b"data: {")]
    final_usage = json.loads(events[-1][6:])["usage"]
    both = (
        usage["prompt_tokens"] + final_usage["prompt_tokens"],
        usage["completion_tokens"] + final_usage["completion_tokens"],
    )
    eventually(lambda: counted("billing"), lambda seen: seen == both)
    assert counted("forged") == (0, 0)


def test_the_gates_minute_slides_and_a_refusal_takes_no_place():
    now = [1000.0]
    gate = TeamGate(clock=lambda: now[0])
    limits = Limits(requests_per_minute=2)
    gate.admit("a", limits).release()
    now[0] += 30
    gate.admit("a", limits).release()
    with pytest.raises(Refused) as refused:
        gate.admit("a", limits)
    assert refused.value.reason == "rate" and refused.value.retry_after == 30  # the first leaves at 1060
    now[0] += 30  # the first has left the window; the refusal never entered it
    ticket = gate.admit("a", limits)
    ticket.release()
    ticket.release()  # idempotent
    assert gate.in_flight() == {}
    narrow = Limits(concurrent_streams=1)
    held = gate.admit("b", narrow)
    with pytest.raises(Refused) as refused:
        gate.admit("b", narrow)
    assert refused.value.reason == "concurrency" and refused.value.retry_after == 1
    held.release()
    gate.admit("b", narrow)


def test_the_limits_file_names_what_is_wrong():
    parsed = parse_team_limits(
        "[default]\nconcurrent_streams = 8\nrequests_per_minute = 120\n"
        "[teams.research]\nconcurrent_streams = 32\n"
        '[teams."batch jobs"]\nrequests_per_minute = "unlimited"\n'
    )
    assert parsed.of("anyone") == Limits(8, 120)
    assert parsed.of("research") == Limits(32, 120)  # the default's rate, key by key
    assert parsed.of("batch jobs") == Limits(8, None)
    assert parse_team_limits("") == parse_team_limits("# no limits\n")
    for text, message in [
        ("[default]\nconcurrent_streams = 0\n", "default.concurrent_streams must be a positive integer"),
        ("[teams.a]\nrpm = 3\n", "teams.a.rpm is not a limit"),
        ("[defaults]\n", "unknown table 'defaults'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_team_limits(text)


def test_the_proxy_refuses_to_start_with_a_limits_file_it_cannot_read(tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nrequests_per_minute = -1\n")
    refusal = start_refused("--team-limits", str(limits), cwd=tmp_path)
    assert "default.requests_per_minute must be a positive integer" in refusal


def test_many_teams_at_once_each_get_their_own_limit(echo_upstream, tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\nrequests_per_minute = 5\n")
    with (
        running_proxy(echo_upstream.url, args=("--team-limits", str(limits))) as proxy,
        ThreadPoolExecutor(8) as pool,
    ):
        statuses = list(pool.map(lambda i: get_models(proxy, team_id=f"t{i % 4}").status_code, range(32)))
    assert statuses.count(200) == 4 * 5 and statuses.count(429) == 32 - 4 * 5


def hold_stream(proxy_url: str, team: str) -> socket.socket:
    """A long streamed request on a bare socket, open until the test closes it (a client that keeps
    reading: requests' own sessions may close a connection the test still means to hold)."""
    url = urlparse(proxy_url)
    body = b'{"text": "hold", "max_tokens": 2000, "stream": true}'
    head = (
        f"POST /predictions/mock HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {token(team_id=team)}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(head.encode() + body)
    return sock


def read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_a_flooding_team_leaves_places_for_another_team_without_any_limits():
    """No limits file: a team that filled the rows and the queue left every other team a 503 until it
    drained. One place in eight (here 1 of 4: 2 rows and 2 queue places) is kept for other teams.
    (Requests with no team, straight to the server, may take every place: test_streaming_e2e's
    test_past_the_queue_is_503_with_retry_after fills its two.)"""
    options = "--mock --rows 2 --max-queue 2 --mock-tokens-per-second 20"
    with running_server(*options.split()) as server, running_proxy(server.url) as proxy:
        flood = []
        for _ in range(2):  # one at a time: a stream's head comes when it has a row, and three at once
            flood.append(hold_stream(proxy.url, "flood"))  # race for the two
            assert read_head(flood[-1]).startswith(b"HTTP/1.1 200")  # in the rows
        flood.append(hold_stream(proxy.url, "flood"))
        eventually(lambda: server.metric("inference_queue_depth"), lambda depth: depth == 1)  # the third
        refused = stream(proxy.url, "flood")
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "your team holds 3 of the server's 4 places" in refused.json()["message"]
        chat = hold_stream(proxy.url, "chat")  # takes the kept place: it waits for a row, not a 503
        eventually(lambda: server.metric("inference_queue_depth"), lambda depth: depth == 2)
        for sock in [*flood, chat]:
            sock.close()
