"""How many prompt tokens a step prefills while rows decode: sized by the step times it measures.

A step that carries a prompt chunk makes every decoding row wait for it. A fixed number of tokens
costs a different time on every machine (on the default model a 128-token chunk took a step of 31
rows to 1.8 times a plain one on one 2-core CPU, 2 to 3 times on another) and at every load. So by
default the budget follows the time: a step is about a plain decode step plus what its chunk adds,
a fixed cost and a cost per prompt token (a line fitted to the steps just run), and the budget is the
number of tokens that keeps a step within `STRETCH` times a plain one. Where the fixed cost alone
takes most of that (on a GPU a plain step is a replayed CUDA graph of 3.5 ms and a step with a chunk
runs eagerly, about 10 ms more whatever its size: an H100, docs/gpu.md), the prompt tokens get as
much time as the fixed cost, so that it is paid for many tokens at once rather than 32 at a time. It
never goes below `FLOOR` (a long prompt must still get on, and with few rows decoding a plain step is
so short that the ratio alone would starve it) nor above the configured ceiling
(`--max-prefill-tokens`). A budget given as a number is kept as it is.

Embedding inputs take what the budget leaves after a step's prompt chunks. The served model's go into
the step's own forward pass and are timed as its prompt tokens are; a separate embedding model's run
in a pass of their own, so their budget also holds to the time left at the cost per token measured on
that path (sized by prefill's cost, 32 inputs of 900 tokens took steps of 350 ms beside a stream whose
steps alone took 20 ms). Where the served model's chunk goes as more decode queries (the CPU's loop,
engine.py), their number follows the steps: one more after a step within `STRETCH` plain steps of
the other queries, one fewer after one past it.
"""

from __future__ import annotations

STRETCH = 1.8  # a step with a chunk takes at most this many plain steps (the goal is twice)
FLOOR = 32  # tokens: a 2,000-token prompt then needs at most 63 steps
FIRST_GUESS = 128  # tokens, until a plain step and a chunk have both been timed
AUTO_CEILING = 512  # tokens, where no ceiling is configured
EMBEDDING_FLOOR = 8  # tokens a step gives embeddings at least, whatever prompts took: they never starve
EMBEDDING_QUERIES = 4  # an embedding input's tokens a step, as decode queries, until steps are timed
SMOOTHING = 0.2  # weight of the newest step in the running averages


class PrefillBudget:
    """The prompt tokens the next step may prefill while rows decode; `observe` each step's time."""

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed if fixed is None else max(1, fixed)  # 0 would never prefill anything
        self.ceiling = self.fixed or AUTO_CEILING
        self.plain_steps: dict[int, float] = {}  # decoding rows: seconds a step of them alone takes
        self.chunks = RunningLine()  # seconds a step's chunk added against the tokens it held
        self.embedding_seconds: float | None = None  # seconds a step's embedding work took, averaged
        self.embedding_tokens_seen: float | None = None  # the tokens it embedded, averaged the same way
        self.embedding_queries_allowed = EMBEDDING_QUERIES

    def forget(self) -> None:
        """Drop what was measured (steps that paid first-call costs, such as compiling)."""
        self.plain_steps.clear()
        self.chunks = RunningLine()
        self.embedding_seconds = self.embedding_tokens_seen = None

    def tokens(self, decoding_rows: int) -> int:
        """The budget of the next step, in which this many rows decode."""
        if self.fixed is not None:
            return self.fixed
        plain, chunk = self.plain_step(decoding_rows), self.chunks.line()
        if plain is None or chunk is None:
            return FIRST_GUESS
        fixed, per_token = chunk
        # What the stretch leaves the tokens after the fixed cost, or where that is less than the fixed
        # cost itself, as much time as it: half a chunk's cost at least is then its tokens'.
        for_tokens = max((STRETCH - 1) * plain - fixed, fixed)
        fitting = int(for_tokens / per_token) if per_token > 0 else self.ceiling
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
            spare = (STRETCH - 1) * plain - self.chunk_cost(prompt_tokens)
            left = min(left, int(spare * self.embedding_tokens_seen / self.embedding_seconds))
        return max(min(EMBEDDING_FLOOR, budget), left)

    def embedding_queries(self, queries: int, spare: int) -> int:
        """How many of an embedding input's tokens a step of `queries` decode queries takes as more of
        them: as many as kept the last such steps within `STRETCH` plain steps (a configured budget:
        its number), `spare` at most."""
        allowed = self.fixed if self.fixed is not None else self.embedding_queries_allowed
        return max(1, min(spare, allowed))

    def observe_embedding_queries(
        self, seconds: float, queries: int, embedded: int, prompt_tokens: int
    ) -> None:
        """A step of `queries` decode queries that took `embedded` more of an embedding input: one more
        the next time if it kept within `STRETCH` plain steps of those queries, else one fewer than it
        took. (A step that also prefilled tells nothing of them, nor one before a plain step was timed.)"""
        plain = self.plain_step(queries)
        if prompt_tokens or plain is None or self.fixed is not None:
            return
        if seconds > STRETCH * plain:
            self.embedding_queries_allowed = max(1, min(self.embedding_queries_allowed, embedded) - 1)
        elif embedded >= self.embedding_queries_allowed:  # (an input's last chunk may be shorter)
            self.embedding_queries_allowed += 1

    def observe_embedding(self, seconds: float, tokens: int) -> None:
        """The time a step's embedding work took beside decoding rows, and the tokens it embedded."""
        if tokens:
            self.embedding_seconds = average(self.embedding_seconds, seconds)
            self.embedding_tokens_seen = average(self.embedding_tokens_seen, tokens)

    def prompt_token_seconds(self) -> float | None:
        """What a prompt token adds to a step, once a chunk has been timed beside a plain step."""
        chunk = self.chunks.line()
        return None if chunk is None else chunk[1]

    def chunk_cost(self, tokens: int) -> float:
        """Seconds a chunk of `tokens` prompt tokens adds to a step, as measured (0 before, or for none)."""
        chunk = self.chunks.line()
        return 0.0 if chunk is None or not tokens else chunk[0] + tokens * chunk[1]

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
            self.chunks.add(prompt_tokens, max(0.0, seconds - plain))


def average(mean: float | None, value: float) -> float:
    """An exponentially weighted running mean; the first value starts it."""
    return value if mean is None else mean + SMOOTHING * (value - mean)


class RunningLine:
    """seconds = fixed + tokens * per_token, fitted by least squares to the recent steps: running means
    (weighted as `average` weighs them) of the tokens, the seconds, and their squares and product."""

    SPREAD = 0.1  # the tokens' spread, over their mean, below which no fixed cost can be told apart

    def __init__(self):
        self.tokens = self.seconds = self.tokens_squared = self.product = None

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = average(self.tokens, tokens)
        self.seconds = average(self.seconds, seconds)
        self.tokens_squared = average(self.tokens_squared, tokens * tokens)
        self.product = average(self.product, tokens * seconds)

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a token), or None before a chunk was timed. Chunks all of about one
        size say nothing of a fixed cost: the seconds are then all the tokens'. Averaging the time and
        the tokens apart weighs each step by its size: a 3-token prompt's step, within the noise of a
        plain one, does not make the cost per token jump; nor does noise make it negative or more than
        the time per token of the chunks as timed."""
        if not self.tokens or not self.seconds:
            return None
        proportional = self.seconds / self.tokens
        spread = self.tokens_squared - self.tokens**2
        if spread <= (self.SPREAD * self.tokens) ** 2:
            return 0.0, proportional
        slope = (self.product - self.tokens * self.seconds) / spread
        per_token = min(max(slope, 0.0), proportional)
        return self.seconds - per_token * self.tokens, per_token
