"""Revoked tokens: the `token_id`s an operator has withdrawn, one a line, from `--revoked-tokens`.

    # lost laptop, 2026-11-02
    alice-laptop
    0f3c9a2e5b7d4e8f9a1b2c3d4e5f6a7b   # the CI token before rotation

A `#` at the start of a line or after a space starts a comment; blank lines are skipped. The file is
read again when it changes (`WatchedFile`), so a revocation counts from the next request, with no restart.
"""

from __future__ import annotations

import re

from proxy.watched_file import WatchedFile

COMMENT = re.compile(r"(?:^|\s)#.*$")


def parse_revoked(text: str) -> frozenset[str]:
    return frozenset(token_id for line in text.splitlines() if (token_id := COMMENT.sub("", line).strip()))


class RevokedTokens:
    def __init__(self, path: str | None):
        self.file = WatchedFile(path, parse_revoked, frozenset(), "revoked tokens") if path else None

    def __contains__(self, token_id: str) -> bool:
        return self.file is not None and token_id in self.file.current()
