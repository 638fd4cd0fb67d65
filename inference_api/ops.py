"""Operations endpoints (SPEC §4.3): /health, /ready, /metrics."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference_api.errors import RETRY_AFTER_NOT_READY, error_response
from inference_api.router import Router

bp = Blueprint("ops", __name__)


@bp.get("/health")
def health() -> Response:
    """The process answers: for liveness probes, which must not restart a server still loading its model."""
    return jsonify(status="ok")


@bp.get("/ready")
def ready() -> Response:
    router: Router = current_app.extensions["router"]
    serving = router.serving
    if serving is None:
        reason = router.failure or router.restart_reason or "the backend is loading or restarting"
        return error_response(503, f"not ready: {reason}", {"Retry-After": str(RETRY_AFTER_NOT_READY)})
    b = serving.backend
    return jsonify(
        status="ready",
        model=serving.model_name,
        rows=b.rows,
        max_seq_len=b.max_seq_len,
        device=b.device,
        dtype=b.dtype,
    )


@bp.get("/metrics")
def metrics() -> Response:
    registry = current_app.extensions["metrics"].registry
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
