"""The C++ kernels of the CPU path and their build.

Owns: the fused decode-step loops (fused_ops.cpp: norms, rotation and
cache writes, attention by position, SiLU, nucleus sampling, int8
rounding), the products of few rows by weights in blocks of 32
(block_matmul.cpp: AVX-512 VNNI and AVX2), a decode step's layers in one
call (decode_layers.cpp), the header they share (fused_ops.h), and
building and loading them as one extension (extension.py).

May import: nothing of the project.
"""
