"""The frontend's handle on the backend process: its inbox, its outbox and its life.

This module never imports torch. The child process imports the real engine
(`backend.engine.serve`) or the mock (`backend.mock`) only once it is running.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import time
from multiprocessing.connection import Connection

from backend.messages import (
    BackendConfig,
    BackendFailed,
    BackendReady,
    Cancel,
    SamplingParams,
    Shutdown,
    StepOutput,
    Submit,
)

log = logging.getLogger(__name__)

# Spawn, not fork: the parent has threads (gunicorn, the router) and the child
# loads torch, and neither survives a fork well.
_mp = multiprocessing.get_context("spawn")


class BackendDied(RuntimeError):
    """The backend process exited while the frontend was waiting on it."""


class BackendStartError(RuntimeError):
    """The backend could not start; the message says why (for the operator)."""


def run_backend(config: BackendConfig, inbox: multiprocessing.Queue, outbox: Connection) -> None:
    """Entry point of the child process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s backend %(levelname)s %(message)s")
    threading.Thread(target=exit_with_parent, name="parent-watch", daemon=True).start()
    if config.mock:
        from backend.mock import serve_mock as serve
    else:
        from backend.utils.thread_binding import bind_compute_threads

        # Before torch is imported (serve imports it)
        places = bind_compute_threads(config.device, config.torch_threads)
        if places is not None:
            log.info("the model's threads are bound one to each core (OpenMP places %s)", places)
        from backend.engine.serve import serve
    serve(config, inbox, outbox)
    # Asked to stop: what it sent is in the pipe already, and the process ends without the interpreter's
    # teardown, which took 1.3 s once a model was loaded (torch's and its libraries' destructors, freeing
    # what the OS takes back anyway), and every stop, restart and end-to-end test waited on it.
    outbox.close()
    logging.shutdown()
    os._exit(0)


def exit_with_parent() -> None:
    """End this process when the one that started it dies, even by SIGKILL.

    Otherwise a killed gunicorn worker would leave its backend holding the
    model's memory, blocked on an inbox nobody writes to.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        log.warning("the frontend process is gone; the backend exits")
        os._exit(0)


class BackendProcess:
    """Start, feed, read and stop one backend process."""

    def __init__(self, config: BackendConfig):
        self.config = config
        self.inbox: multiprocessing.Queue = _mp.Queue()
        # The outbox is a one-way pipe that the backend's loop writes itself (Connection.send), not a
        # Queue: a Queue's put wakes a feeder thread to pickle and write each step's pieces, which then
        # waits for the GIL and for a core while the next step's threads hold both (on 2 cores: 0.4-1.2
        # ms between steps, one stream 1% slower; docs/backend.md). The router thread reads it at once,
        # so the pipe's buffer does not fill.
        self.outbox, self._outbox_writer = _mp.Pipe(duplex=False)
        self.process = _mp.Process(
            target=run_backend, args=(config, self.inbox, self._outbox_writer), name="backend", daemon=True
        )

    def start(self) -> BackendProcess:
        self.process.start()
        # The child has its own end now; with this one closed, a backend that dies mid-message leaves an
        # end of file to read (BackendDied), not a message that never completes.
        self._outbox_writer.close()
        log.info("backend process %d started (%s)", self.process.pid, "mock" if self.config.mock else "model")
        return self

    def wait_ready(self, timeout: float | None = None) -> BackendReady:
        """Block until the model is loaded and warmed up; raise if the backend fails."""
        message = self.receive(timeout)
        if isinstance(message, BackendFailed):
            raise BackendStartError(message.message)
        if not isinstance(message, BackendReady):
            raise BackendStartError(f"backend sent {type(message).__name__} before it was ready")
        return message

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        cache_scope: str = "",
        team: str = "",
        adapter: str = "",
    ) -> None:
        self.inbox.put(Submit(request_id, tuple(prompt_ids), params, cache_scope, team, adapter))

    def cancel(self, request_id: str) -> None:
        self.inbox.put(Cancel(request_id))

    def receive(self, timeout: float | None = None) -> BackendReady | BackendFailed | StepOutput:
        """The next message from the backend.

        Blocks on the outbox and on the process at once, so that a backend that
        dies wakes the caller (BackendDied) instead of leaving it waiting.
        Raises queue.Empty after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Anything it sent before dying is still in the pipe: read that first.
            if self.outbox.poll():
                try:
                    return self.outbox.recv()
                except (EOFError, OSError):  # its end is closed: it died, between messages or in one
                    self.process.join(1)
                    raise BackendDied(f"backend process exited with code {self.process.exitcode}") from None
            if not self.process.is_alive():
                raise BackendDied(f"backend process exited with code {self.process.exitcode}")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise queue.Empty
            multiprocessing.connection.wait([self.outbox, self.process.sentinel], remaining)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the backend to finish, then make sure it does."""
        if self.process.is_alive():
            with contextlib.suppress(ValueError, OSError):
                self.inbox.put(Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            log.warning("backend did not stop in %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        self.inbox.close()
        self.inbox.cancel_join_thread()
        self.outbox.close()
