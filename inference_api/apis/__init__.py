"""One package or module per API the server speaks, each its routes beside its request parsing.

- openai/: /v1/models, /v1/completions, /v1/chat/completions (routes.py), their request bodies
  (request.py) and their logprobs (logprobs.py);
- anthropic/: Anthropic's /v1/messages;
- responses/: OpenAI's /v1/responses, stateless;
- llama_stack/: Llama Stack's inference API;
- native/: the native API, POST /predictions/<model> (SPEC §4.1);
- embeddings.py: /v1/embeddings; tokenize.py: /tokenize and /detokenize.

May import: the shared pieces of inference_api (fields, errors, prompts, generation, the router,
the chat template, structured output, tool calls) and backend.messages; never another API's
package, nor torch.
"""
