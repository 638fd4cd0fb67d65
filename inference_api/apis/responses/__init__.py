"""OpenAI's Responses API, stateless: POST /v1/responses, its routes and its request."""
