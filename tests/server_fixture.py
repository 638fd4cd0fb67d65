"""The real server (`python -m inference_api ...` under gunicorn) in a subprocess, for end-to-end tests.

    with running_server("--mock", "--rows", "2") as server:
        requests.post(f"{server.url}/predictions/mock", json={"text": "hi"})

With no --mock it serves a real model (`--model PATH_OR_ID`, or the default
one); pass a longer ready_timeout then.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import openai
import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path
    # The official clients made for this server, closed before it stops (see stop_server)
    clients: list[openai.OpenAI | anthropic.Anthropic] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai_client(self, timeout: float = 120) -> openai.OpenAI:
        """The official client, unchanged, pointed at the server."""
        client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="not-needed", max_retries=0, timeout=timeout
        )
        self.clients.append(client)
        return client

    def anthropic_client(self, timeout: float = 120) -> anthropic.Anthropic:
        """Anthropic's official client, unchanged, pointed at the server."""
        client = anthropic.Anthropic(base_url=self.url, api_key="not-needed", max_retries=0, timeout=timeout)
        self.clients.append(client)
        return client

    def worker(self) -> psutil.Process:
        """gunicorn's one worker (the server's pid is gunicorn's master: `python -m` execs it)."""
        children = psutil.Process(self.process.pid).children()
        if len(children) != 1:
            raise AssertionError(f"expected one gunicorn worker, found {children}")
        return children[0]

    def backend_pid(self) -> int:
        """The backend process: the worker's multiprocessing child (not its resource tracker)."""
        for child in self.worker().children():
            cmdline = " ".join(child.cmdline())
            if "spawn_main" in cmdline:
                return child.pid
        raise AssertionError("the gunicorn worker has no backend process")

    def metric(self, name: str) -> float:
        """A metric's value from /metrics (the first sample of that exact name)."""
        for line in requests.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def wait_ready(self, timeout: float, path: str = "/ready") -> None:
        """Until `path` answers 200 (the proxy, which has no /ready of its own, waits on /health)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.process.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                if requests.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not up yet, or slow on a loaded machine
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready in {timeout} s:\n{self.log()[-4000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, log_path: Path) -> RunningServer:
    """Start without waiting for readiness (see running_server)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "inference_api", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        # A session of its own, so that teardown can reach every process the server started.
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return RunningServer(f"http://127.0.0.1:{port}", process, log_path)


def stop_server(server: RunningServer, timeout: float = 20.0) -> None:
    """Stop as an operator would (SIGTERM), then make sure nothing it started is left.

    The clients made for it close their kept-alive connections first: gunicorn's stopping worker keeps
    each open up to 2 s more (for a request a client may be sending on it), and the suite's servers
    waited those 2 s at every stop, a minute in all."""
    for client in server.clients:
        client.close()
    gc.collect()  # and a test's own client that is garbage now lets go of its connection
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout)
    # A zombie has exited already: waiting for it waited on init to reap it, up to 1.7 s a server here.
    leftovers = [p for p in psutil.process_iter() if _in_group(p, process.pid) and not _zombie(p)]
    _, alive = psutil.wait_procs(leftovers, timeout=5)
    for p in alive:
        p.kill()
    if process.poll() is None:
        process.kill()
        process.wait()


def _zombie(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group
    except (ProcessLookupError, PermissionError):
        return False


@contextmanager
def running_server(*args: str, ready_timeout: float = 60.0) -> Iterator[RunningServer]:
    """A server that answers /ready with 200, stopped on exit; its log is printed if it fails to start."""
    with tempfile.TemporaryDirectory(prefix="inference-api-") as tmp:
        server = start_server(*args, log_path=Path(tmp) / "server.log")
        try:
            server.wait_ready(ready_timeout)
            yield server
        finally:
            stop_server(server)
