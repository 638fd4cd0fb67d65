"""The OpenAI-compatible API (SPEC §4.2): routes, request bodies and logprobs."""
