"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (routes.py), its request
(request.py), its content blocks in chat's shapes (conversation.py) and its tools (tools.py)."""
