"""Small helpers over the process and the device that every package may use.

Owns: the heap's policy for freed memory (heap.py), host lists turned
into device tensors without a sync (host_lists.py), and the hub's token and
downloads of LoRA adapters named by hub id (hub.py; no torch, the frontend
imports it).

May import: nothing of the project.
"""
