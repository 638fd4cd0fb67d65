"""gunicorn settings for inference_api: one gthread worker, which owns one backend process.

`python -m inference_api` passes its options in INFERENCE_* environment
variables (inference_api/config.py); `gunicorn -c gunicorn.conf.py` with the
same variables runs the same server.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inference_api.config import ServerConfig  # noqa: E402

_config = ServerConfig.from_env()

# The app factory runs in the worker (no preload): the backend process is the worker's child.
wsgi_app = "inference_api:create_app()"
bind = [f"{_config.host}:{_config.port}"]
# One worker: the backend owns the whole device, and a second worker would load a second model.
workers = 1
# gthread's, counting connections right, answering before the grace ends and errors in JSON.
worker_class = "inference_api.worker.ApiWorker"
# gunicorn's logger, but a client that hangs up is an info line and a 499, not an error with a traceback.
logger_class = "inference_api.gunicorn_logger.ApiLogger"
# A request holds its thread for as long as it streams, so there is one per request in flight.
threads = _config.threads
# gthread heartbeats from its main loop, not from request threads: long streams are fine.
timeout = 30
# An idle kept-alive connection stays open 10 s, past the 5 s after which httpx's pools (the openai and
# anthropic clients') drop one: the client lets it go first. With gunicorn's 2 s, a request a client sent
# on one in the instant the server closed it failed ("Server disconnected without sending a response").
keepalive = 10
graceful_timeout = 10
# gunicorn's control socket lives at one path per user: a second server (tests run several) would
# take it over. Nothing here uses gunicornc.
control_socket_disable = True
# A backend that cannot start stops the server (see ServerConfig.exit_on_backend_failure).
raw_env = ["INFERENCE_EXIT_ON_BACKEND_FAILURE=1"]


def post_fork(server, worker):
    """The frontend's own log lines go where gunicorn's go."""
    for name in ("inference_api", "backend"):
        logger = logging.getLogger(name)
        logger.handlers = list(server.log.error_log.handlers)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def worker_exit(server, worker):
    """The backend stops with the worker. (The master also calls this, with a worker that has no app.)"""
    app = getattr(worker, "wsgi", None)
    router = getattr(app, "extensions", {}).get("router")
    if router is not None:
        router.stop()
