"""A backend that dies mid-message, for tests/backend/test_process.py. A module of its own, which imports
no torch: the spawned child imports the module its target is in, and the test module's imports (torch,
transformers) took that child 13 s to start."""

import os
import struct

from backend.messages import Piece, StepOutput


def send_then_die_mid_message(outbox) -> None:
    """A backend's last moments: one whole message, larger than a pipe's buffer, then the start of another."""
    outbox.send(StepOutput([Piece("long", "x" * 300_000)]))
    os.write(outbox.fileno(), struct.pack("!i", 1_000_000) + b"partial")  # a length, then 7 of its bytes
    os._exit(3)
