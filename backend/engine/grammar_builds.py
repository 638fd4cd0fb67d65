"""Grammars compiled beside the engine's thread, so that one request's big schema stalls no other row.

A request's grammar is compiled before it waits for a row (a grammar the
matcher refuses is its error at once). A usual schema compiles in 0.6 to
2.5 ms, but a 50,000-value enum or a 2,000-way `anyOf` takes about 0.3 s,
and compiled in the engine's thread it stopped every row's step for as
long: a stream beside three such requests saw gaps of up to 404-442 ms
against 26-33 alone (scripts/bench_grammar_stall.py, docs/performance.md).
llguidance releases the GIL while it compiles (another thread's longest
wait: 9 ms), so a thread of its own lets the steps go on.

The engine waits a little for each build (`SUBMIT_WAIT_SECONDS`), so that
the usual grammar is ready for the step about to run, as when it was
compiled in place; a build still going after that leaves its request here,
and a later step queues it once its matcher is ready. Builds get half the
machine's cores (one of two): each takes a core from the forward pass's
threads while it runs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from backend.layers.grammar import GrammarError, Grammars
from backend.messages import Submit
from backend.utils.thread_binding import spread_this_thread

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)

# How long a request's arrival waits for its grammar: four times a 30-property schema's build (2.5 ms on
# the 2-core EPYC), under a one-row step of the default model there (16 ms): the longest a big schema's
# build holds up the engine's thread.
SUBMIT_WAIT_SECONDS = 0.01
# How long an engine with nothing else to do sleeps on the builds before it reads its inbox again.
IDLE_WAIT_SECONDS = 0.05

Built = tuple[Submit, "LLMatcher | None | GrammarError"]  # a request and its matcher, or why it has none


class GrammarBuilds:
    """Requests whose grammar is compiling, oldest first, each with its build."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self.requests: collections.OrderedDict[str, Submit] = collections.OrderedDict()
        self._builds: dict[str, concurrent.futures.Future] = {}
        workers = max(1, (os.cpu_count() or 1) // 2)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="grammar", initializer=spread_this_thread
        )

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def make_tokenizer(self) -> concurrent.futures.Future:
        """Make llguidance's view of the tokenizer in a build's thread (Grammars.make_tokenizer)."""
        return self._pool.submit(self.grammars.make_tokenizer)

    def start(self, request: Submit) -> None:
        """Begin compiling the request's grammar, and wait up to `SUBMIT_WAIT_SECONDS` for it where no
        other build is under way (one that is would make each request behind it wait that long)."""
        build = self._pool.submit(self.grammars.matcher, request.params.grammar)
        self.requests[request.request_id] = request
        self._builds[request.request_id] = build
        if all(other.done() for other in self._builds.values() if other is not build):
            concurrent.futures.wait([build], timeout=SUBMIT_WAIT_SECONDS)

    def wait(self, timeout: float = IDLE_WAIT_SECONDS) -> None:
        """Sleep until a build ends, or `timeout` seconds."""
        concurrent.futures.wait(self._builds.values(), timeout, concurrent.futures.FIRST_COMPLETED)

    def finished(self) -> Iterator[Built]:
        """The requests whose build ended, oldest first, out of here: each with its matcher, or the
        GrammarError that refused its grammar."""
        for request_id in [request_id for request_id, build in self._builds.items() if build.done()]:
            build = self._builds.pop(request_id)
            request = self.requests.pop(request_id)
            try:
                yield request, build.result()
            except GrammarError as error:
                yield request, error
            except BaseException as error:  # llguidance's panics (pyo3's PanicException) are BaseExceptions
                log.exception("compiling a grammar failed")
                yield request, GrammarError(f"the grammar could not be compiled: {error}")

    def drop(self, request_id: str) -> None:
        """Forget a request (cancelled, or its adapter unloaded); a build under way ends unread."""
        del self.requests[request_id]
        self._builds.pop(request_id).cancel()
