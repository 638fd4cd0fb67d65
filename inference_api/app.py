"""The app factory: one Flask app, one router thread, one backend process.

The OpenAI API's blueprints are registered twice: at /v1/ and at /v1/openai/v1/, where Llama Stack's
client calls them (chat and completions, models, embeddings).
"""

from __future__ import annotations

import logging
import os
import re
import uuid

from flask import Flask, Response, current_app, g, request

from inference_api import openapi, ops, page
from inference_api.apis import embeddings, lora_adapters, rerank, tei_embed, tokenize
from inference_api.apis.anthropic import routes as anthropic_api
from inference_api.apis.llama_stack import routes as llama_stack_api
from inference_api.apis.llamacpp import routes as llamacpp_api
from inference_api.apis.native import routes as native_api
from inference_api.apis.ollama import routes as ollama_api
from inference_api.apis.openai import routes as openai_api
from inference_api.apis.responses import routes as responses_api
from inference_api.apis.tgi import routes as tgi_api
from inference_api.client_watch import CLIENT_CLOSED_REQUEST, hang_up_in_flight
from inference_api.config import ServerConfig
from inference_api.errors import register_error_handlers
from inference_api.json_answers import PiecewiseJSONProvider
from inference_api.metrics import Metrics
from inference_api.router import Router, Serving
from inference_api.vllm_metrics import VllmMetrics

log = logging.getLogger(__name__)

# A client's X-Request-ID is echoed if it looks like an id, so that it is safe in logs and headers.
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
GUNICORN_APP_LOAD_ERROR = 4  # a worker exiting with it makes gunicorn's master halt instead of respawning


def create_app(config: ServerConfig | None = None) -> Flask:
    """Build the app and start its backend; config None reads INFERENCE_* variables (the gunicorn path).

    The backend loads in the background: /ready answers 503 until it is ready,
    so gunicorn's worker boots at once, however long the model takes.
    """
    config = config or ServerConfig.from_env()
    app = Flask(__name__, static_folder=None)  # the page blueprint serves /static/
    app.json = PiecewiseJSONProvider(app)  # a big answer's writing lets the streams' tokens through
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["SERVER"] = config
    metrics = Metrics()
    router = Router(
        config.backend,
        config.max_queue,
        metrics,
        restart_delay=config.restart_delay,
        step_timeout=config.step_timeout,
        on_ready=lambda serving: _log_ready(config, serving),
        on_fatal=_exit_worker if config.exit_on_backend_failure else None,
        served_model_names=config.served_model_names,
        chat_template=config.chat_template,
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
    )
    metrics.registry.register(VllmMetrics(metrics, router))
    app.extensions["metrics"] = metrics
    app.extensions["router"] = router

    register_error_handlers(app)
    app.before_request(_assign_request_id)
    app.after_request(_finish_response)
    app.register_blueprint(native_api.bp)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(ops.bp)
    app.register_blueprint(page.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(tokenize.bp)
    app.register_blueprint(anthropic_api.bp)
    app.register_blueprint(responses_api.bp)
    app.register_blueprint(llama_stack_api.bp)
    app.register_blueprint(tgi_api.bp)
    app.register_blueprint(llamacpp_api.bp)
    app.register_blueprint(ollama_api.bp)
    app.register_blueprint(embeddings.bp)
    app.register_blueprint(rerank.bp)
    app.register_blueprint(tei_embed.bp)
    app.register_blueprint(lora_adapters.bp)
    # Llama Stack's client calls the OpenAI API under its own prefix: the same handlers, served there too.
    llama_stack_openai = openai_api.LLAMA_STACK_PREFIX
    app.register_blueprint(openai_api.bp, url_prefix=llama_stack_openai, name="llama_stack_openai")
    app.register_blueprint(embeddings.bp, url_prefix=llama_stack_openai, name="llama_stack_embeddings")

    router.start()
    return app


def _assign_request_id() -> None:
    client_id = request.headers.get("X-Request-ID", "")
    g.request_id = client_id if SANE_REQUEST_ID.fullmatch(client_id) else uuid.uuid4().hex


def _finish_response(response: Response) -> Response:
    if "request_id" not in g:
        _assign_request_id()
    response.headers["X-Request-ID"] = g.request_id
    endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
    metrics: Metrics = current_app.extensions["metrics"]
    if response.is_streamed:
        # Counted when it ends: a stream whose client left midway is a 499, as in gunicorn's access log.
        response.call_on_close(lambda: _count_stream(metrics, endpoint, response.status_code))
    else:
        metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
    return response


def _count_stream(metrics: Metrics, endpoint: str, status: int) -> None:
    """At the response's close(), which gunicorn calls with the hang-up that cut it still in flight."""
    ended = CLIENT_CLOSED_REQUEST if hang_up_in_flight() else status
    metrics.requests.labels(endpoint=endpoint, status=str(ended)).inc()


def _log_ready(config: ServerConfig, serving: Serving) -> None:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    url = f"http://{host}:{config.port}"
    log.info(
        "ready on %s; try:\n  curl -N %s/predictions/%s -H 'Content-Type: application/json' "
        '-d \'{"text": "Once upon a time", "max_tokens": 64}\'',
        url,
        url,
        serving.model_name,
    )


def _exit_worker(message: str) -> None:
    log.critical("stopping the server: the backend cannot start (%s)", message)
    logging.shutdown()
    os._exit(GUNICORN_APP_LOAD_ERROR)
