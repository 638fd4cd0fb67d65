"""The JWT reverse proxy in front of one or more inference servers (SPEC §6).

No torch here: the proxy only checks tokens and moves bytes. `create_app` is in
`proxy.app`, not imported here: gunicorn's master imports `proxy.config` and
`proxy.worker`, and the worker must patch the standard library for gevent
before `requests` (and the ssl module through it) is first imported.
"""
