"""The engine's methods above a transformers module's own class (Falcon's attention, a hybrid's mixers,
a latent-attention layer): the engine's within its step, the module's own, through `super()`, elsewhere.
The module keeps its weights and its state; only its class changes."""

from __future__ import annotations

import functools

from torch import nn


def mix_in(module: nn.Module, mixin: type) -> None:
    """Put `mixin` above the module's own class; a module that has it already is left as it is."""
    if not isinstance(module, mixin):
        module.__class__ = _mixed(mixin, type(module))


@functools.cache
def _mixed(mixin: type, own: type) -> type:
    """One class for each pair, which every module of that class shares."""
    return type(f"{own.__name__}{mixin.__name__}", (mixin, own), {})
