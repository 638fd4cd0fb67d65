"""Llama Stack's inference API: completion, chat completion and embeddings, its routes and its requests."""
