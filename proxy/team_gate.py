"""Each team's streams in flight and requests in the last minute, held against its limits.

The counts live in this process: the proxy runs one gunicorn worker (gunicorn_conf.py), so every
request of a proxy instance passes here. Several proxy replicas each count their own requests, so a
team's effective limit is the configured one times the replicas it is balanced over (docs/proxy.md).

A request holds its streams (stream_cost.py: prompts x n on the OpenAI endpoints that fan out, else one)
in flight from admission until its answer has been sent whole or its client has gone (`Ticket.release`,
idempotent); one that takes more streams than its team may hold at all is refused outright (400: no
retry would let it through). The minute is a sliding window: a request is refused while
`requests_per_minute` admitted ones are less than 60 seconds old, and `Retry-After` is when the oldest
of them leaves the window. A refused request takes no place in either count.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from proxy.limits import Limits

WINDOW_SECONDS = 60.0
RETRY_AFTER_CONCURRENCY = 1  # a stream ends within seconds; there is no telling which one or when


class Refused(Exception):
    def __init__(self, reason: str, message: str, retry_after: int | None, status: int = 429):
        super().__init__(message)
        self.reason = reason  # "concurrency", "rate" or "streams", the label of the rejection counter
        self.message = message
        self.retry_after = retry_after  # None: no retry will pass (a 400)
        self.status = status


class Ticket:
    """A request's streams in its team's count of streams in flight."""

    def __init__(self, gate: TeamGate, team: str, streams: int):
        self.gate = gate
        self.team = team
        self.streams = streams
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate._release(self.team, self.streams)


class TeamGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        # Admission times in the window, kept only for teams with a rate limit: at most that many each.
        self._admitted: dict[str, deque[float]] = {}

    def admit(self, team: str, limits: Limits, streams: int = 1) -> Ticket:
        """A ticket for one more request of `team` taking `streams` streams, or Refused if a limit is
        reached (429), or can never let it through (400)."""
        with self._lock:
            in_flight = self._in_flight.get(team, 0)
            most = limits.concurrent_streams
            if most is not None and streams > most:
                raise Refused(
                    "streams",
                    f"this request takes {streams} streams (prompts x n); your team may hold {most} at once",
                    None,
                    400,
                )
            if most is not None and in_flight + streams > most:
                raise Refused(
                    "concurrency",
                    f"your team has {in_flight} of its {most} streams in flight and this request takes "
                    f"{streams}; retry when one ends",
                    RETRY_AFTER_CONCURRENCY,
                )
            per_minute = limits.requests_per_minute
            if per_minute is None:
                self._admitted.pop(team, None)
            else:
                now = self.clock()
                admitted = self._admitted.setdefault(team, deque())
                while admitted and admitted[0] <= now - WINDOW_SECONDS:
                    admitted.popleft()
                if len(admitted) >= per_minute:
                    # The window has room again when all but per_minute - 1 of them have left it.
                    frees_at = admitted[len(admitted) - per_minute] + WINDOW_SECONDS
                    raise Refused(
                        "rate",
                        f"your team's limit is {per_minute} requests per minute",
                        max(1, math.ceil(frees_at - now)),
                    )
                admitted.append(now)
            self._in_flight[team] = in_flight + streams
        return Ticket(self, team, streams)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_flight)

    def _release(self, team: str, streams: int) -> None:
        with self._lock:
            left = self._in_flight[team] - streams
            if left:
                self._in_flight[team] = left
            else:
                del self._in_flight[team]  # idle teams take no memory
