"""The certificate and key the proxy's workers load: the master's private copies of the last good pair
(`--certfile`, `--keyfile`).

Renewing is: replace the two files, send gunicorn's master SIGHUP; it starts a new worker, which loads
the pair as it starts, and stops the old one. Loaded straight from the operator's files, a key that did
not match its certificate (the new certificate copied, the old key left) made every new worker crash as
it started, over and over, and the TLS port served nothing: a full outage. So the master copies the pair
into a private folder when the proxy starts and on each SIGHUP (gunicorn_conf.py's hooks), checks the
copies, and only then hands them to the workers. A pair that does not load, or that a client would
refuse (expired, not yet valid), leaves the last good one serving with an error in the log, as
proxy/watched_file.py does for the limits and the revoked tokens. A worker restarted for any other
reason loads the same copies, never a half-renewed pair.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from proxy.tls import client_objection, load_problem


class UnusablePair(RuntimeError):
    """At start, where there is no last good pair to keep: gunicorn stops with this message."""


class ServedPair:
    def __init__(self, certfile: str, keyfile: str, log: logging.Logger):
        """Copies the pair, or raises UnusablePair; `log` is the master's (gunicorn's error log)."""
        self.certfile, self.keyfile = certfile, keyfile
        self.log = log
        self.folder = Path(tempfile.mkdtemp(prefix="proxy-tls-"))  # 0700: the key stays private
        self.files = (str(self.folder / "cert.pem"), str(self.folder / "key.pem"))
        staged, problem = self._stage()
        if problem:
            self.remove()
            raise UnusablePair(f"--certfile {certfile} --keyfile {keyfile}: {problem}")
        if objection := client_objection(*staged):
            # Nothing better to serve: serve it, and say so.
            log.warning("--certfile %s: %s; clients will refuse it until it is renewed", certfile, objection)
        self._serve(staged)

    def renew(self) -> None:
        """On SIGHUP: the operator's pair, if it is good; else the last good one, and an error."""
        staged, problem = self._stage()
        if problem := problem or client_objection(*staged):
            self.log.error(
                "--certfile %s --keyfile %s: %s; still serving the last good pair (fix the files and send "
                "SIGHUP again)",
                self.certfile,
                self.keyfile,
                problem,
            )
            return
        self._serve(staged)
        self.log.info("TLS: serving the pair now in --certfile %s --keyfile %s", self.certfile, self.keyfile)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _stage(self) -> tuple[tuple[str, str], str | None]:
        """Copies of the operator's files, and why they do not load (None: they do). The copies are what
        is checked and then served: a file replaced meanwhile cannot slip past the check."""
        staged = (str(self.folder / "new-cert.pem"), str(self.folder / "new-key.pem"))
        try:
            shutil.copyfile(self.certfile, staged[0])
            shutil.copyfile(self.keyfile, staged[1])
        except OSError as error:
            return staged, str(error)
        return staged, load_problem(*staged)

    def _serve(self, staged: tuple[str, str]) -> None:
        # In the master, between workers' starts: no worker loads the pair while it is replaced.
        for new, served in zip(staged, self.files, strict=True):
            os.replace(new, served)
