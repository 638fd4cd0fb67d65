"""The batching engine: user rows over one KV cache, scheduled and stepped (SPEC §5).

Owns: the engine's step (engine.py), which request takes which row and how
much of each prompt a step prefills (scheduler.py, prefill_budget.py,
prefix_cache.py), grammars compiled beside the steps (grammar_builds.py),
one row's state and text (row.py, detokenizer.py, stop_matcher.py), and
the backend process's loop over its queues (serve.py, inbox.py).

May import: backend.model, backend.layers, backend.quant, backend.kernels,
backend.utils and backend.messages; never inference_api. Importing this
package (or stop_matcher, which the frontend and the mock use) imports no
torch.
"""
