"""What the operator of a shared server controls per team (SPEC §6): revoked tokens, limits on requests
in flight and per minute, and each team's usage in the proxy's metrics."""

from __future__ import annotations

from proxy.auth import AuthError, Caller
from proxy.config import ProxyConfig
from proxy.limits import TeamLimits, parse_team_limits
from proxy.metrics import ProxyMetrics
from proxy.revoked import RevokedTokens
from proxy.team_gate import Refused, TeamGate, Ticket
from proxy.watched_file import WatchedFile


class Teams:
    def __init__(self, config: ProxyConfig):
        self.revoked = RevokedTokens(config.revoked_tokens)
        self.limits = (
            WatchedFile(config.team_limits, parse_team_limits, TeamLimits(), "team limits")
            if config.team_limits
            else None
        )
        self.gate = TeamGate()
        self.metrics = ProxyMetrics(self.gate.in_flight)

    def admit(self, caller: Caller, streams: int = 1) -> Ticket:
        """The caller's `streams` among its team's streams in flight, to release when its answer is sent;
        AuthError (401) if its token is revoked, Refused (429, or 400) past a limit of its team."""
        if caller.token_id in self.revoked:
            self.metrics.count_rejection(caller.team_label, "revoked")
            raise AuthError("the token has been revoked")
        limits = self.limits.current().of(caller.team_id) if self.limits else TeamLimits().default
        try:
            return self.gate.admit(caller.team_label, limits, streams)
        except Refused as refusal:
            self.metrics.count_rejection(caller.team_label, refusal.reason)
            raise
