"""One package or module per API the server speaks, each its routes beside its request parsing.

- openai/: /v1/models, /v1/completions, /v1/chat/completions (routes.py), their request bodies
  (request.py) and their logprobs (logprobs.py);
- anthropic/: Anthropic's /v1/messages (with tool use) and /v1/messages/count_tokens;
- responses/: OpenAI's /v1/responses, stateless;
- llama_stack/: Llama Stack's inference API (completion, chat completion, embeddings);
- native/: the native API, POST /predictions/<model> (SPEC §4.1);
- tgi/: Text Generation Inference's /generate, /generate_stream, POST / and /info;
- embeddings.py: /v1/embeddings; rerank.py: /v1/rerank (/rerank, /v2/rerank), /v1/score;
- tokenize.py: /tokenize and /detokenize.
- lora_adapters.py: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora).

Llama Stack's client also calls openai/ and embeddings.py at /v1/openai/v1/ (app.py registers them there).

May import: the shared pieces of inference_api (fields, errors, prompts, generation, the embedder, the router,
the chat template, structured output, tool calls) and backend.messages; never another API's
package, nor torch.
"""
