"""The chat page (SPEC §4.4): GET / and its style sheet and script under /static/.

Plain files shipped in inference_api/static/, no build step and nothing from
the internet: the page is a client of /v1/models and /v1/chat/completions like
any other, so it works the same straight to the server or through the proxy.
"""

from __future__ import annotations

from flask import Blueprint, Response, send_from_directory

# The blueprint owns /static/ (the app is built with static_folder=None), so all of the page is here.
bp = Blueprint("page", __name__, static_folder="static", static_url_path="/static")


@bp.get("/")
def chat_page() -> Response:
    return send_from_directory(bp.static_folder, "index.html")
