"""scripts/jwt_util.py issues tokens the proxy accepts, and reads them back."""

import json
import os
import subprocess
import sys
import time

import requests

from tests.proxy.conftest import SECRET
from tests.server_fixture import ROOT

SCRIPT = str(ROOT / "scripts" / "jwt_util.py")


def jwt_util(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=30)


def test_encode_then_decode_round_trips_the_claims_and_adds_an_expiry():
    encoded = jwt_util("--secret", SECRET, "encode", '{"team_id": "t", "token_id": "x"}', "--exp", "60")
    assert encoded.returncode == 0, encoded.stderr
    claims = json.loads(jwt_util("--secret", SECRET, "decode", encoded.stdout.strip()).stdout)
    assert claims["team_id"] == "t" and claims["token_id"] == "x"
    assert 50 < claims["exp"] - time.time() <= 60


def test_decode_refuses_a_wrong_secret_and_encode_refuses_missing_claims():
    encoded = jwt_util("--secret", SECRET, "encode", '{"team_id": "t", "token_id": "x"}').stdout.strip()
    wrong = jwt_util("--secret", "another-" + SECRET, "decode", encoded)
    assert wrong.returncode == 1 and "Signature verification failed" in wrong.stderr
    missing = jwt_util("--secret", SECRET, "encode", '{"team_id": "t"}')
    assert missing.returncode == 1 and "token_id" in missing.stderr


def test_a_token_from_jwt_util_passes_the_proxy(proxy):
    encoded = jwt_util("--secret", SECRET, "encode", '{"team_id": "t", "token_id": "x"}').stdout.strip()
    response = requests.get(f"{proxy.url}/ready", headers={"Authorization": f"Bearer {encoded}"}, timeout=10)
    assert response.status_code == 200


def test_token_mints_a_team_token_with_a_fresh_id_each_time():
    first = jwt_util("--secret", SECRET, "token", "--team", "research", "--hours", "0.5")
    second = jwt_util("--secret", SECRET, "token", "--team", "research")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    claims = [
        json.loads(jwt_util("--secret", SECRET, "decode", t.stdout.strip()).stdout) for t in (first, second)
    ]
    assert [c["team_id"] for c in claims] == ["research", "research"]
    assert claims[0]["token_id"] != claims[1]["token_id"]
    assert 1700 < claims[0]["exp"] - time.time() <= 1800
    refused = jwt_util("--secret", SECRET, "token", "--team", "research", "--hours", "0")
    assert refused.returncode == 1 and "--hours must be positive" in refused.stderr


def test_token_says_its_team_id_and_expiry_on_stderr_and_id_reads_a_tokens_id_without_the_secret():
    minted = jwt_util("--secret", SECRET, "token", "--team", "research", "--token-id", "alice-laptop")
    assert minted.returncode == 0, minted.stderr
    assert minted.stdout.count("\n") == 1  # the token alone, for TOKEN=$(make token ...)
    expiry = time.strftime("%Y-%m-%d %H:", time.gmtime(time.time() + 24 * 3600))
    assert minted.stderr.startswith(f"team research, token id alice-laptop, expires {expiry}")
    token = minted.stdout.strip()
    read = subprocess.run(
        [sys.executable, SCRIPT, "id", token],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"]},
        cwd=ROOT / "tests",  # no JWT_SECRET, no .env
    )
    assert read.returncode == 0 and read.stdout.strip() == "alice-laptop", read.stderr
    expired = jwt_util(
        "--secret", "rotated-since", "encode", '{"team_id": "t", "token_id": "old"}', "--exp", "-60"
    )
    assert jwt_util("id", expired.stdout.strip()).stdout.strip() == "old"
    garbage = jwt_util("id", "not-a-token")
    assert garbage.returncode == 1 and garbage.stderr.startswith("jwt_util: ")
