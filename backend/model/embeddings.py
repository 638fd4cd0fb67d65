"""Embeddings: a prompt's hidden states at the model's last layer, pooled into one normalised vector.

An embedding request takes no user row and samples nothing. While rows decode, the served model
embeds one input at a time inside the rows' own steps: a chunk a step (`EmbeddingJob`) into a spare
row of the cache, the step giving back the chunk's last hidden states. On the CPU's loop the chunk's
tokens are more decode queries of that row (the step stays a decode step); elsewhere the chunk is
prefilled as a prompt chunk is, within what the prefill budget leaves. A pass of its own would cost a
decoding row about three steps' time whatever it embedded (a 2-core CPU, docs/performance.md); 32
inputs of 900 tokens embedded whole held a decoding row's next token for up to 16.6 s. With no row
decoding nobody waits: the inputs that wait go whole in one padded forward pass of the model's base
(transformers' own, without the head).

With `--embedding-model` the vectors come from a separate model instead (a sentence-embedding
model, often a BERT-like encoder): whatever transformers' AutoModel loads whose output has
last_hidden_state, pooled the same way; the frontend tokenizes its inputs with its own tokenizer.
A separate model's pass reads its inputs whole and goes a few layers a step (engine/encoder_pass.py).

With `--rerank-model` a cross-encoder scores (query, document) pairs for /v1/rerank: transformers'
AutoModelForSequenceClassification with one label (BERT- and XLM-RoBERTa-like rerankers), each pair read
whole as its tokenizer joins the two texts, its one logit sent back (the APIs' relevance score is its
sigmoid, as vLLM and Text Embeddings Inference give it). Its requests are embedding requests whose
pooling is messages.SCORE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

POOLINGS = ("mean", "last")  # the mean of every token's hidden state, or the last token's
DEFAULT_MAX_TOKENS = 512  # for a model whose config names no max_position_embeddings


@dataclass(frozen=True)
class EmbeddingModel:
    """A separate model that answers embedding requests in place of the served one, or scores pairs."""

    name: str  # what its requests' `model` names
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
    input_ids, mask = padded(prompts, model.device)
    lengths = mask.sum(dim=1)
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state.float()
    if pooling == "last":
        pooled = hidden[torch.arange(len(prompts), device=model.device), lengths - 1]
    else:
        pooled = (hidden * mask[..., None]).sum(dim=1) / lengths[:, None]
    return torch.nn.functional.normalize(pooled, dim=-1)


def score(model: PreTrainedModel, pairs: list[tuple[tuple[int, ...], int | None]]) -> torch.Tensor:
    """[pairs] relevance logits, float32: each (query, document) pair's one logit from a
    sequence-classification model (the APIs give its sigmoid, or the logit itself where asked). A pair
    is its token ids and where its second text begins (token type 1 from there; None: one type
    throughout, as XLM-RoBERTa's tokenizer has it)."""
    prompts = [prompt for prompt, _ in pairs]
    input_ids, mask = padded(prompts, model.device)
    types = torch.zeros_like(input_ids)
    for i, (prompt, start) in enumerate(pairs):
        if start is not None:
            types[i, start : len(prompt)] = 1
    inputs = {"input_ids": input_ids, "attention_mask": mask.long()}
    # A model of one token type (XLM-RoBERTa's) has no second type to read, whatever a tokenizer says.
    if any(start is not None for _, start in pairs) and getattr(model.config, "type_vocab_size", 2) > 1:
        inputs["token_type_ids"] = types
    return model(**inputs).logits[:, 0].float()


def padded(prompts: list[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids right-padded into one [prompts, longest] batch, and the mask of real tokens."""
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
    input_ids = torch.zeros((len(prompts), int(lengths.max())), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(prompt, device=device)
    return input_ids, torch.arange(input_ids.shape[1], device=device) < lengths[:, None]


class EmbeddingJob:
    """One input embedded by the served model a chunk a step, prefilled in the cache's embedding row
    beside the rows' own chunks (a `PrefillingRow` of step_inputs.py): each chunk reads the earlier ones
    from that row, as one pass over the whole input would, and the pooled states add up as it goes.
    (An encoder's tokens each read every other, so a separate model's pass goes by layers instead.)"""

    def __init__(self, prompt: tuple[int, ...], pooling: str, row: int):
        self.prompt_ids, self.pooling, self.index = prompt, pooling, row
        self.cached = 0  # the tokens embedded so far
        self.chunk_end = 0  # where this step's chunk ends
        self.as_queries = False  # this step's chunk as decode queries of its row (step_inputs.py)
        self.scores_prompt = False  # (a PrefillingRow's: an input scores nothing)
        self.total: torch.Tensor | None = None  # the sum of every token's hidden state so far
        self.last: torch.Tensor | None = None

    @property
    def left(self) -> int:
        return len(self.prompt_ids) - self.cached

    def take(self, tokens: int, as_queries: bool = False) -> int:
        """The next step's chunk: up to `tokens` more of the input; returns its length."""
        self.chunk_end = self.cached + min(tokens, self.left)
        self.as_queries = as_queries
        return self.chunk_end - self.cached

    def add(self, states: torch.Tensor) -> bool:
        """The chunk's last hidden states ([tokens, hidden]), once its step has run; whether the input is
        all embedded."""
        states = states.float()
        self.total = states.sum(dim=0) + (0 if self.total is None else self.total)
        self.last = states[-1]
        self.cached = self.chunk_end
        return self.left == 0

    def vector(self) -> torch.Tensor:
        pooled = self.last if self.pooling == "last" else self.total / len(self.prompt_ids)
        return torch.nn.functional.normalize(pooled, dim=-1)
