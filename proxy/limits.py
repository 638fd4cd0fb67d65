"""Per-team limits, from the TOML file `--team-limits` names (read again when it changes):

    # Every team not listed below.
    [default]
    concurrent_streams = 8        # requests in flight at once
    requests_per_minute = 120     # in any 60 seconds

    [teams.research]
    concurrent_streams = 32       # requests_per_minute: the default's 120

    [teams."batch jobs"]
    requests_per_minute = "unlimited"

A team's table overrides the default key by key; a key absent everywhere, or "unlimited", is no limit.
No file, or an empty one: no limits at all. Team names are the tokens' `team_id` claims, as they are.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace

UNLIMITED = "unlimited"


@dataclass(frozen=True)
class Limits:
    """One team's limits; None is no limit."""

    concurrent_streams: int | None = None
    requests_per_minute: int | None = None


@dataclass(frozen=True)
class TeamLimits:
    default: Limits = Limits()
    teams: dict[str, Limits] = field(default_factory=dict)

    def of(self, team_id: str) -> Limits:
        return self.teams.get(team_id, self.default)


def parse_team_limits(text: str) -> TeamLimits:
    """The file's limits, or ValueError naming the key that is wrong."""
    document = tomllib.loads(text)
    unknown = set(document) - {"default", "teams"}
    if unknown:
        raise ValueError(f"unknown table {sorted(unknown)[0]!r}: only [default] and [teams.NAME]")
    default = _limits(document.get("default", {}), Limits(), "default")
    teams = document.get("teams", {})
    if not isinstance(teams, dict):
        raise ValueError("teams must be tables: [teams.NAME]")
    return TeamLimits(
        default, {name: _limits(table, default, f"teams.{name}") for name, table in teams.items()}
    )


def _limits(table: object, base: Limits, where: str) -> Limits:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    names = {f.name for f in fields(Limits)}
    for key, value in table.items():
        if key not in names:
            raise ValueError(f"{where}.{key} is not a limit: use {' or '.join(sorted(names))}")
        if value != UNLIMITED and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'{where}.{key} must be a positive integer or "{UNLIMITED}", not {value!r}')
    return replace(base, **{key: None if value == UNLIMITED else value for key, value in table.items()})
