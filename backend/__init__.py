"""The process that owns the model: a KV cache of user rows decoded together.

Importing this package does not import torch: the frontend imports
`backend.messages` and `backend.process`, and only the backend process itself
loads `backend.engine.engine`.
"""
