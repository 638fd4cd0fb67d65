"""gunicorn settings for the proxy: `JWT_SECRET=... gunicorn -c proxy/gunicorn_conf.py`.

`python -m proxy` sets the PROXY_* variables from its options and runs this.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from proxy.config import ProxyConfig  # noqa: E402
from proxy.served_pair import ServedPair  # noqa: E402

_config = ProxyConfig.from_env()

wsgi_app = "proxy.app:create_app()"
bind = [f"{_config.host}:{_config.port}"]
if _config.health_port:
    # Its own listener has its own pool of connections: the liveness probe gets in however busy
    # the main port is (the app answers only /health there).
    bind.append(f"{_config.host}:{_config.health_port}")
workers = 1
# A greenlet per connection (gevent's worker with the proxy's header and body deadlines): slow
# clients hold memory, not threads. docs/deploy.md, "Slow clients", has the measurements.
worker_class = "proxy.worker.ProxyWorker"
worker_connections = _config.max_connections
keepalive = 1  # on (ProxyWorker's header deadline, not this, bounds the wait for the next request)
timeout = 30
graceful_timeout = 10
control_socket_disable = True
# Never log request headers: they carry tokens. The default access log format has none.


def post_fork(server, worker):
    """The proxy's own log lines (team and token ids, never tokens) go where gunicorn's go."""
    import logging

    for name in ("proxy",):
        logger = logging.getLogger(name)
        logger.handlers = list(server.log.error_log.handlers)
        logger.setLevel(logging.INFO)
        logger.propagate = False


# TLS: the workers load the master's copy of the last good pair, taken at start and on each SIGHUP,
# so that a botched renewal leaves the last good pair serving (proxy/served_pair.py).


def on_starting(server):
    server.served_pair = None
    if _config.certfile:
        server.served_pair = ServedPair(_config.certfile, _config.keyfile, server.log.error_log)


def on_reload(server):
    if server.served_pair:
        server.served_pair.renew()


def pre_fork(server, worker):
    if server.served_pair:
        worker.tls_files = server.served_pair.files


def on_exit(server):
    if server.served_pair:
        server.served_pair.remove()
