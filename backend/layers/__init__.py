"""The pieces a forward pass and a step are made of, each a pure function or a small module.

Owns: attention over the row cache (attention.py, with the step's packed
layout in step_layout.py), the KV cache (row_cache.py), the decode step's
norms, rotary embedding, SiLU and attention as PyTorch operations or the
CPU's loops (decode_ops.py), sampling (sampler.py), penalties and biases
(logits_processors.py), grammar masks (grammar.py) and logprobs
(logprobs.py). Quantized linear layers are in backend.quant.

May import: backend.kernels, backend.utils and backend.messages.
"""
