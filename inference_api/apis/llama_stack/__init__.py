"""Llama Stack's inference API: completion and chat completion, its routes and its requests."""
