"""A file an operator edits while the proxy runs (the revoked tokens, the team limits), read again when
it changes.

`current()` looks at the file's status (one `stat`, a few microseconds) on every call, so that an edit
counts from the next request on. A file that cannot be read or parsed after a good reading leaves the
last good content in force, with an error in the log: a half-written or mistyped file, or one deleted
by mistake, must not lift every revocation or limit at once. Missing when the proxy starts, it stands
for `empty` (a warning says so); unparseable then, the proxy refuses to start (`FileError`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("proxy")

T = TypeVar("T")


class FileError(ValueError):
    """The file is there but says nothing the proxy can use; the message names the file and the line."""


class WatchedFile(Generic[T]):
    def __init__(self, path: str, parse: Callable[[str], T], empty: T, what: str):
        """`parse` turns the text into the content, raising ValueError with a message for an operator;
        `what` names the file in log lines ("the revoked tokens")."""
        self.path = path
        self.parse = parse
        self.what = what
        self._value = empty
        self._signature: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        try:
            signature = self._stat()
        except FileNotFoundError:
            log.warning("%s file %s does not exist: none until it does", what, path)
            return
        try:
            self._value, self._signature = self._read(), signature
        except (OSError, ValueError) as error:
            raise FileError(f"{what} file {path}: {error}") from None
        log.info("%s: read %s", what, path)

    def current(self) -> T:
        try:
            signature = self._stat()
        except OSError as error:
            if self._signature is not None:
                log.error("%s file %s: %s; keeping what it said before", self.what, self.path, error)
                self._signature = None  # said once; read again when it is back
            return self._value
        if signature != self._signature:
            with self._lock:
                if signature != self._signature:
                    self._reload(signature)
        return self._value

    def _stat(self) -> tuple[int, int, int]:
        status = os.stat(self.path)  # follows symbolic links: a Kubernetes ConfigMap swaps one
        return (status.st_mtime_ns, status.st_size, status.st_ino)

    def _read(self) -> T:
        with open(self.path, encoding="utf-8") as file:
            return self.parse(file.read())

    def _reload(self, signature: tuple[int, int, int]) -> None:
        # The signature is the one seen before reading: a write during the read shows as a new one.
        self._signature = signature
        try:
            self._value = self._read()
        except (OSError, ValueError) as error:
            log.error("%s file %s: %s; keeping what it said before", self.what, self.path, error)
            return
        log.info("%s: read %s again", self.what, self.path)
