"""Ollama's API (/api/...)."""
