"""A model's forward pass run a few layers at a time, between the engine's steps.

An encoder (a rerank or embedding model beside the served one, embeddings.py) reads an input whole:
each token attends to every other, so its pass cannot go a chunk of tokens a step as the served
model's own inputs do. Whole, it held a stream's next token for the whole pass: about 80 ms for one
418-token pair on ms-marco-MiniLM-L-6-v2's shape on a 2-core CPU, beside 10-ms decode steps
(docs/performance.md). Its layers can go apart, though. The pass runs on a thread of its own, and a
hook before each layer waits there until the engine lets it run more; the engine's thread waits in
turn while those layers run. So the two never run at once (nor compete for the cores), the hidden
states stay on the paused pass's stack between steps, and any model transformers runs layer by layer
splits so, whatever its architecture: its layers are its module list of num_hidden_layers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


class Abandoned(Exception):
    """Raised in a paused pass's thread to end it (`StagedPass.abandon`)."""


class StagedPass:
    """`forward()` (a pass of a model whose `layers` are hooked here) run a few layers at a time by
    `advance`; its `result` once `done`, or the `error` it raised."""

    def __init__(self, forward: Callable[[], torch.Tensor], layers: Sequence[torch.nn.Module]):
        self.layers = max(1, len(layers))
        self.layers_run = 0
        self.result: torch.Tensor | None = None
        self.error: Exception | None = None
        self.done = False
        self._allowed = 0  # layers the pass may still start before it waits
        self._abandoned = False
        self._resume = threading.Semaphore(0)  # the engine lets the pass run on
        self._paused = threading.Semaphore(0)  # the pass waits before a layer, or has ended
        self._hooks = [layer.register_forward_pre_hook(self._before_layer) for layer in layers]
        self._thread = threading.Thread(target=self._run, args=(forward,), name="staged-pass", daemon=True)
        self._thread.start()

    def advance(self, layers: int) -> None:
        """Run `layers` more layers (one at least; with the last, what follows them: the pooling, the
        head), and return once they have run."""
        if self.done:
            return
        self._allowed = max(1, layers)
        self._resume.release()
        self._paused.acquire()

    def finish(self) -> None:
        """Run the rest of the pass."""
        self.advance(self.layers)

    def abandon(self) -> None:
        """End the pass where it waits, its thread with it."""
        if not self.done:
            self._abandoned = True
            self.advance(1)

    def _before_layer(self, module: torch.nn.Module, args: tuple) -> None:
        if threading.current_thread() is not self._thread:
            return  # the same model run whole by the engine's own thread
        if self._allowed == 0:
            self._paused.release()
            self._resume.acquire()
        if self._abandoned:
            raise Abandoned
        self._allowed -= 1
        self.layers_run += 1

    def _run(self, forward: Callable[[], torch.Tensor]) -> None:
        self._resume.acquire()  # the first `advance`
        try:
            if self._abandoned:
                raise Abandoned
            with torch.inference_mode():  # (a thread's own: the engine's step does not reach here)
                self.result = forward()
        except Abandoned:
            pass
        except Exception as error:
            self.error = error
        finally:
            for hook in self._hooks:
                hook.remove()
            self.done = True
            self._paused.release()


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's layers: its module list of as many as its config's num_hidden_layers (BERT's
    encoder.layer, ModernBERT's layers); none found, no layers (the pass then runs whole)."""
    config = getattr(model, "config", None)
    count = getattr(config.get_text_config(), "num_hidden_layers", None) if config is not None else None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and count and len(module) == count:
            return list(module)
    return []
