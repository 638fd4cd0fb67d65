"""GET /openapi.json: the OpenAPI 3.1 description of every endpoint, inference_api's and the proxy's.

The document is a static file beside this module, written by hand; the tests
check real responses and the documented ranges against it so that it cannot drift.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response

DOCUMENT_PATH = Path(__file__).resolve().parent / "openapi.json"

bp = Blueprint("openapi", __name__)


@bp.get("/openapi.json")
def openapi_document() -> Response:
    return Response(DOCUMENT_PATH.read_bytes(), content_type="application/json")
