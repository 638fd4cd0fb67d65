"""The HTTP API server: Flask under gunicorn, in front of one backend process (SPEC §1, §4)."""

from inference_api.app import create_app

__all__ = ["create_app"]
