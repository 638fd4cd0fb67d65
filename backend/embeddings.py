"""Embeddings: a prompt's hidden states at the model's last layer, pooled into one normalised vector.

An embedding request takes no row: it needs no cache and samples nothing. Each step, after the
rows' forward pass, the engine embeds the waiting prompts up to its prefill budget in tokens (at
least one prompt), in one padded forward pass of the model's base (transformers' own, without the
head), so that embedding requests share the machine with decoding rows instead of stalling them.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

POOLINGS = ("mean", "last")  # the mean of every token's hidden state, or the last token's


def embed(model: PreTrainedModel, prompts: list[tuple[int, ...]], pooling: str) -> torch.Tensor:
    """[prompts, hidden] unit vectors, float32: each prompt's last-layer hidden states, pooled."""
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=model.device)
    input_ids = torch.zeros((len(prompts), int(lengths.max())), dtype=torch.long, device=model.device)
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(prompt, device=model.device)
    mask = torch.arange(input_ids.shape[1], device=model.device) < lengths[:, None]  # right padding
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state.float()
    if pooling == "last":
        pooled = hidden[torch.arange(len(prompts), device=model.device), lengths - 1]
    else:
        pooled = (hidden * mask[..., None]).sum(dim=1) / lengths[:, None]
    return torch.nn.functional.normalize(pooled, dim=-1)
