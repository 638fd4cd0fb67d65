"""Quantized weights: the linear layers that serve them and the files and steps they come from.

Owns: weight-only quantized linear layers, 4-bit and 8-bit, and fusing
them (quantized_linear.py), a mixture of experts' weights as such layers
(quantized_experts.py), `--quantize` over a whole model (quantize.py),
weights in blocks of 32 as llama.cpp stores
them (block_weights.py), the int8 path of many rows (smoothed_int8.py),
reading a GGUF file's blocks (gguf_weights.py, each type's in
gguf_types.py), GPTQ and AWQ checkpoints (group_wise.py), compressed-tensors
checkpoints (compressed_checkpoint.py), bitsandbytes checkpoints
(bitsandbytes_checkpoint.py), the layers of those three served in one loop
(checkpoint_layers.py), and the measurements made
at load time that choose between those paths (calibration.py).

May import: backend.kernels, backend.utils and backend.messages.
"""
