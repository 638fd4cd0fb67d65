"""Small helpers over the process and the device that every package may use.

Owns: the heap's policy for freed memory (heap.py) and host lists turned
into device tensors without a sync (host_lists.py).

May import: nothing of the project.
"""
