"""The model: loading it, saying whether it is served, and running a step's forward pass.

Owns: finding, checking and loading a model and its tokenizer (loader.py,
resources.py, cache_size.py), the supported-architecture registry
(architectures.py), a step's inputs packed for the forward pass
(step_inputs.py), the forward pass itself (model_runner.py: the compact
decoder runner of decoder_runner.py, or transformers' own classes with
the engine's attention), which code runs each step shape (step_plan.py),
its fast paths (native_decode.py on a CPU, decode_graphs.py on a GPU),
and embeddings (embeddings.py). A model family that needs code of its own
gets a file here.

May import: backend.layers, backend.quant, backend.kernels, backend.utils
and backend.messages; never backend.engine.
"""
