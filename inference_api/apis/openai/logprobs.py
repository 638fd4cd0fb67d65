"""Log-probabilities in OpenAI's two shapes, from the backend's TokenLogprob entries.

Legacy completions (`logprobs: N`):

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}

with the echoed prompt's tokens first (the first one scored None, as
nothing predicts it) and text_offset counting characters of the returned
text. Chat (`logprobs: true, top_logprobs: N`):

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A streamed response carries the entries of each chunk's tokens in the
chunk; their offsets run on from the chunk before. With vLLM's
`return_tokens_as_token_ids` a token is named `token_id:{id}`, so that one
that is not whole text (part of a character) is known exactly.

vLLM's `prompt_logprobs: N` (a completion's choice, or a chat response)
scores the prompt in vLLM's own shape, a map for each prompt token:

    [null, {"1234": {"logprob", "rank", "decoded_token"}, ...}, ...]

the prompt's token (ranked among the whole vocabulary) and the N most
likely in its place (ranked 1 to N).
"""

from __future__ import annotations

from typing import Any

from backend.messages import TokenLogprob
from inference_api.tokenizer import PromptTokenizer

# OpenAI writes an impossible token's logprob as a large negative number, not -Infinity, which is
# not JSON (a bias of -100 can make a top alternative's probability underflow to 0).
LOWEST_LOGPROB = -9999.0


class TokenNames:
    """How the logprobs name a token: its text, or (`as_ids`) `token_id:{id}`, as vLLM's
    return_tokens_as_token_ids asks."""

    def __init__(self, tokenizer: PromptTokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


class CompletionLogprobs:
    """One choice's legacy logprobs, chunk by chunk."""

    def __init__(self, names: TokenNames, top: int, prompt_ids: list[int] | None = None):
        self.names = names
        self.top = top  # alternatives a token: an echoed prompt's entries may carry more (prompt_logprobs)
        self.offset = 0  # characters of the choice's text so far
        self.first_prompt_token = prompt_ids[0] if prompt_ids else None

    def shape(self, entries: tuple[TokenLogprob | None, ...]) -> dict[str, Any]:
        """Entries of the next tokens (prompt ones first when echoed: None for the first)."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            if entry is None:  # the echoed prompt's first token
                token_id, logprob, top = self.first_prompt_token, None, None
            else:
                token_id, logprob = entry.token_id, finite(entry.logprob)
                top = {self.names.name(t): finite(v) for t, v in entry.top[: self.top]}
            tokens.append(self.names.name(token_id))
            logprobs.append(logprob)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(self.names.text(token_id))  # characters of the text, however it is named
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


class ChatLogprobs:
    """One choice's chat logprobs, chunk by chunk."""

    def __init__(self, names: TokenNames):
        self.names = names

    def shape(self, entries: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        return {"content": [self._token(entry.token_id, entry.logprob, entry.top) for entry in entries]}

    def _token(
        self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...] | None
    ) -> dict[str, Any]:
        token_bytes = list(self.names.tokenizer.token_bytes(token_id))  # a part of a character's, too
        entry = {"token": self.names.name(token_id), "logprob": finite(logprob), "bytes": token_bytes}
        if top is not None:
            entry["top_logprobs"] = [self._token(t, v, None) for t, v in top]
        return entry


class PromptLogprobs:
    """vLLM's prompt_logprobs: each prompt token's score and the `top` most likely tokens in its place."""

    def __init__(self, names: TokenNames, top: int):
        self.names = names
        self.top = top

    def shape(self, entries: tuple[TokenLogprob | None, ...]) -> list[dict[str, Any] | None]:
        return [None if entry is None else self._position(entry) for entry in entries]

    def _position(self, entry: TokenLogprob) -> dict[str, Any]:
        """The prompt's token (with its rank in the vocabulary) and the alternatives ranked by their
        place, as vLLM gives them; a token among both is given once."""
        scores = {str(entry.token_id): self._score(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top[: self.top], start=1):
            scores.setdefault(str(token_id), self._score(token_id, logprob, rank))
        return scores

    def _score(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": self.names.text(token_id)}


def finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)
