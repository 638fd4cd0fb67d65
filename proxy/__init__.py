"""The JWT reverse proxy in front of one or more inference servers (SPEC §6).

No torch here: the proxy only checks tokens and moves bytes.
"""

from proxy.app import create_app

__all__ = ["create_app"]
