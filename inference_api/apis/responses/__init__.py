"""OpenAI's Responses API, stateless: POST /v1/responses. Its routes (the response object and its events),
its request, its input and output items, its tools (served through tool_calls.py) and its text format."""
