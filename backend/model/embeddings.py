"""Embeddings: a prompt's hidden states at the model's last layer, pooled into one normalised vector.

An embedding request takes no row: it needs no row of the cache and samples nothing. Each step,
after the rows' forward pass, the engine embeds waiting prompts within the step's budget of prompt
tokens (the prefill budget, sized by the measured step times, less what the step prefilled), so
that embedding requests share the machine with decoding rows instead of stalling them: prompts that
fit whole go in one padded forward pass of the model's base (transformers' own, without the head);
a longer one goes a chunk a step (`EmbeddingJob`, the served model's earlier chunks in a cache of
its own), as a long prompt is prefilled. 32 inputs of 900 tokens, embedded whole, held a decoding
row's next token for up to 16.6 s on a 2-core CPU.

With `--embedding-model` the vectors come from a separate model instead (a sentence-embedding
model, often a BERT-like encoder): whatever transformers' AutoModel loads whose output has
last_hidden_state, pooled the same way; the frontend tokenizes its inputs with its own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

POOLINGS = ("mean", "last")  # the mean of every token's hidden state, or the last token's
DEFAULT_MAX_TOKENS = 512  # for a model whose config names no max_position_embeddings


@dataclass(frozen=True)
class EmbeddingModel:
    """A separate model that answers embedding requests in place of the served one."""

    name: str  # what an embeddings request's `model` names
    model: PreTrainedModel
    tokenizer_path: str  # a directory with its tokenizer.json, for the frontend
    max_tokens: int  # the most tokens an input may have: its position embeddings

    @classmethod
    def of(
        cls, name: str, model: PreTrainedModel, tokenizer_path: str, tokenizer_limit: int | None = None
    ) -> EmbeddingModel:
        """`tokenizer_limit`: the tokenizer's model_max_length, where it knows one. RoBERTa-like
        models say 514 positions and take 512 tokens (their positions start after the padding id)."""
        config = model.config.get_text_config()
        max_tokens = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_TOKENS
        return cls(name, model.eval(), tokenizer_path, min(max_tokens, tokenizer_limit or max_tokens))

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings


def embed(model: PreTrainedModel, prompts: list[tuple[int, ...]], pooling: str) -> torch.Tensor:
    """[prompts, hidden] unit vectors, float32: each prompt's last-layer hidden states, pooled.

    `model` is a causal LM (its base, without the head, runs) or a base model itself (an AutoModel
    such as BertModel, which is its own base_model)."""
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


class EmbeddingJob:
    """One prompt embedded a chunk at a time by a causal model: each chunk reads the earlier ones from
    its own cache, as one pass over the whole prompt would; the pooled states add up as it goes.
    (An encoder's tokens each read every other, so a separate embedding model embeds a prompt whole.)"""

    def __init__(self, prompt: tuple[int, ...], pooling: str):
        self.prompt, self.pooling = prompt, pooling
        self.cache = DynamicCache()
        self.done = 0
        self.total: torch.Tensor | None = None  # the sum of every token's hidden state so far
        self.last: torch.Tensor | None = None

    @property
    def left(self) -> int:
        return len(self.prompt) - self.done

    def advance(self, model: PreTrainedModel, tokens: int) -> bool:
        """Embed up to `tokens` more of the prompt; whether it is all done."""
        chunk = torch.tensor([self.prompt[self.done : self.done + tokens]], device=model.device)
        output = model.base_model(input_ids=chunk, past_key_values=self.cache, use_cache=True)
        hidden = output.last_hidden_state[0].float()
        self.total = hidden.sum(dim=0) + (0 if self.total is None else self.total)
        self.last = hidden[-1]
        self.done += chunk.shape[1]
        return self.left == 0

    def vector(self) -> torch.Tensor:
        pooled = self.last if self.pooling == "last" else self.total / len(self.prompt)
        return torch.nn.functional.normalize(pooled, dim=-1)
