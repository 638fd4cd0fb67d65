"""`make run`'s script starts the server and the proxy and prints a curl line that works as printed."""

import os
import signal
import subprocess
import sys

import psutil

from tests.server_fixture import ROOT, free_port


def test_the_printed_curl_line_streams_through_the_proxy(tmp_path):
    env = dict(os.environ, INFERENCE_PORT=str(free_port()), PROXY_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    env.pop("JWT_SECRET", None)
    run = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "run_stack.py"), "--mock"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        curl_line = None
        for line in run.stdout:
            if line.startswith("curl -N "):
                curl_line = line.strip()
                break
        assert curl_line is not None, "no curl line printed"
        assert "JWT_SECRET=" in (tmp_path / ".env").read_text()  # generated and kept
        result = subprocess.run(
            ["bash", "-c", curl_line + " -sS -w '\\n%{http_code}'"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        text, status = result.stdout.rsplit("\n", 1)
        assert status == "200", result.stdout + result.stderr
        assert len(text.split()) == 64  # the mock writes one word per token
    finally:
        children = psutil.Process(run.pid).children(recursive=True)
        os.kill(run.pid, signal.SIGTERM)
        run.wait(60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == [], f"left running: {alive}"
