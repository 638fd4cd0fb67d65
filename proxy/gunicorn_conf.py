"""gunicorn settings for the proxy: `JWT_SECRET=... gunicorn -c proxy/gunicorn_conf.py`.

`python -m proxy` sets the PROXY_* variables from its options and runs this.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from proxy.config import ProxyConfig  # noqa: E402

_config = ProxyConfig.from_env()

wsgi_app = "proxy:create_app()"
bind = [f"{_config.host}:{_config.port}"]
workers = 1
worker_class = "gthread"
# Each stream holds a thread for as long as it lasts.
threads = _config.threads
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
