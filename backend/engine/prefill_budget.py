"""How many prompt tokens a step prefills while rows decode: sized by the step times it measures.

A step that carries a prompt chunk makes every decoding row wait for it. A fixed number of tokens
costs a different time on every machine (on the default model a 128-token chunk took a step of 31
rows to 1.8 times a plain one on one 2-core CPU, 2 to 3 times on another) and at every load. So by
default the budget follows the time: a step is about a plain decode step plus a cost per prompt
token, both measured on the steps just run, and the budget is the number of tokens that keeps a
step within `STRETCH` times a plain one. It never goes below `FLOOR` (a long prompt must still get
on, and with few rows decoding a plain step is so short that the ratio alone would starve it) nor
above the configured ceiling (`--max-prefill-tokens`). A budget given as a number is kept as it is.

Embedding inputs take what a step's time leaves after its prompt chunks, at the cost per token measured
on their own path (a separate forward with a cache of its own, several times slower per token than a
prefill chunk's: sized by prefill's cost, 32 inputs of 900 tokens took steps of 350 ms beside a stream
whose steps alone took 20 ms).
"""

from __future__ import annotations

STRETCH = 1.8  # a step with a chunk takes at most this many plain steps (the goal is twice)
FLOOR = 32  # tokens: a 2,000-token prompt then needs at most 63 steps
FIRST_GUESS = 128  # tokens, until a plain step and a chunk have both been timed
AUTO_CEILING = 512  # tokens, where no ceiling is configured
EMBEDDING_FLOOR = 8  # tokens a step gives embeddings at least, whatever prompts took: they never starve
SMOOTHING = 0.2  # weight of the newest step in the running averages


class PrefillBudget:
    """The prompt tokens the next step may prefill while rows decode; `observe` each step's time."""

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed if fixed is None else max(1, fixed)  # 0 would never prefill anything
        self.ceiling = self.fixed or AUTO_CEILING
        self.plain_steps: dict[int, float] = {}  # decoding rows: seconds a step of them alone takes
        self.chunk_seconds: float | None = None  # seconds a step's chunk added, averaged
        self.chunk_tokens: float | None = None  # the tokens it held, averaged the same way
        self.embedding_seconds: float | None = None  # seconds a step's embedding work took, averaged
        self.embedding_tokens_seen: float | None = None  # the tokens it embedded, averaged the same way

    def forget(self) -> None:
        """Drop what was measured (steps that paid first-call costs, such as compiling)."""
        self.plain_steps.clear()
        self.chunk_seconds = self.chunk_tokens = None
        self.embedding_seconds = self.embedding_tokens_seen = None

    def tokens(self, decoding_rows: int) -> int:
        """The budget of the next step, in which this many rows decode."""
        if self.fixed is not None:
            return self.fixed
        plain, per_token = self.plain_step(decoding_rows), self.prompt_token_seconds()
        if plain is None or per_token is None:
            return FIRST_GUESS
        fitting = int((STRETCH - 1) * plain / per_token)
        return max(FLOOR, min(self.ceiling, fitting))

    def embedding_tokens(self, decoding_rows: int, prompt_tokens: int) -> int:
        """The tokens of embedding inputs the next step may take beside its `prompt_tokens` of prompt
        chunks: what the budget leaves, and once both costs are measured, no more than the time left
        within `STRETCH` plain steps pays for at embeddings' own cost per token; `EMBEDDING_FLOOR` at
        least (never more than the budget)."""
        budget = self.tokens(decoding_rows)
        left = budget - prompt_tokens
        plain = self.plain_step(decoding_rows)
        # (A configured budget times no plain step: it stays a number.)
        if plain is not None and self.embedding_seconds and self.embedding_tokens_seen:
            spare = (STRETCH - 1) * plain - prompt_tokens * (self.prompt_token_seconds() or 0.0)
            left = min(left, int(spare * self.embedding_tokens_seen / self.embedding_seconds))
        return max(min(EMBEDDING_FLOOR, budget), left)

    def observe_embedding(self, seconds: float, tokens: int) -> None:
        """The time a step's embedding work took beside decoding rows, and the tokens it embedded."""
        if tokens:
            self.embedding_seconds = average(self.embedding_seconds, seconds)
            self.embedding_tokens_seen = average(self.embedding_tokens_seen, tokens)

    def prompt_token_seconds(self) -> float | None:
        """What a prompt token adds to a step, once a chunk has been timed beside a plain step."""
        if not self.chunk_seconds or not self.chunk_tokens:
            return None
        return self.chunk_seconds / self.chunk_tokens

    def plain_step(self, decoding_rows: int) -> float | None:
        """A plain step's time for this many decoding rows, or the nearest number timed."""
        if not self.plain_steps:
            return None
        return self.plain_steps[min(self.plain_steps, key=lambda rows: abs(rows - decoding_rows))]

    def observe(self, seconds: float, decoding_rows: int, prompt_tokens: int) -> None:
        """A step's time: of decoding rows alone, or of decoding rows and `prompt_tokens` of prompts.

        Steps with no decoding row prefill whole prompts and tell nothing about either cost."""
        if self.fixed is not None or not decoding_rows:
            return
        plain = self.plain_step(decoding_rows)
        if not prompt_tokens:
            self.plain_steps[decoding_rows] = average(self.plain_steps.get(decoding_rows), seconds)
        elif plain is not None:
            # Averaging the time and the tokens apart weighs each step by its size: a 3-token prompt's
            # step, within the noise of a plain one, does not make the cost per token jump.
            self.chunk_seconds = average(self.chunk_seconds, max(0.0, seconds - plain))
            self.chunk_tokens = average(self.chunk_tokens, prompt_tokens)


def average(mean: float | None, value: float) -> float:
    """An exponentially weighted running mean; the first value starts it."""
    return value if mean is None else mean + SMOOTHING * (value - mean)
