"""Reading the backend's inbox: block when idle, never block when busy."""

from __future__ import annotations

import multiprocessing
import queue

from backend.messages import Cancel, LoadAdapter, Shutdown, Submit, UnloadAdapter

InboxMessage = Submit | Cancel | LoadAdapter | UnloadAdapter | Shutdown


def read_inbox(inbox: multiprocessing.Queue, timeout: float | None) -> list[InboxMessage]:
    """Everything waiting on the inbox.

    `timeout` is how long to wait for the first message: None waits for ever
    (nothing to do until a request comes), 0 does not wait (rows are busy).
    """
    messages = []
    try:
        if timeout is None or timeout > 0:
            messages.append(inbox.get(timeout=timeout))
        while True:
            messages.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return messages
