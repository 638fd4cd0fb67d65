"""Anthropic's Messages API: POST /v1/messages, its routes and its request."""
