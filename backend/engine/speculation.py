"""Speculative decoding: several of a row's tokens from one read of the weights.

A decode step of one row reads every weight to make one token; the same
read can score a few more. Each step, `Speculator.draft` gives rows a
draft, the tokens prompt lookup guesses will follow (prompt_lookup.py),
and the step feeds each such row [its last token, draft...] at consecutive
positions: on a CPU as more decode queries of the same row, each reading
its row up to its own position, elsewhere as a chunk of the row, as a
prompt's next chunk runs (model/step_inputs.py). Every position's logits
are then sampled as plain decoding would sample them there, with the
row's own settings and the draw number of the token it would be
(sampler.py: a draw is a function of the logits, the seed and that
number), and the row takes the tokens sampled up to the first that differs
from the draft, that one included (`verified`). So the output is token for
token the output of plain decoding, greedy or seeded, whatever is
accepted; and unseeded, each token comes from the model's own
distribution. A draft that is a single guess per position is accepted with
the probability the speculative-sampling papers' rejection rule gives it,
p(draft token), so nothing is lost by matching instead. The keys and
values the rejected tokens wrote stay in the row past its length and are
overwritten by the next step: rolling back is the row's length alone.

What rows draft: those that asked for it (`SamplingParams.speculative`),
with nothing that depends on the tokens before each position (penalties,
`logit_bias` and `min_tokens` count them; a grammar's mask follows them):
those rows decode a token a step, as before. And how many tokens a step
drafts: a step of few rows is bound by reading the weights, and its
extra queries cost little; a full step is bound by the arithmetic, and
they would slow every row. `Speculator.draft` gives drafts only the
queries a step has spare below `step_queries` (docs/backend.md has the
measurements).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from backend.engine.prompt_lookup import PromptLookup

if TYPE_CHECKING:
    from backend.engine.row import Row

# The most draft tokens a row gets a step by default, and the most queries (rows and draft tokens) a step
# fills with drafts: measured (docs/backend.md, "Speculative decoding").
DRAFT_TOKENS = 8
STEP_QUERIES = 16


class Speculator:
    """Gives a step's decoding rows their drafts; counts what was drafted and accepted."""

    def __init__(self, tokens: int, shortest: int, longest: int, step_queries: int):
        self.tokens = tokens  # the longest draft a row gets; 0: speculation is off
        self.shortest, self.longest = shortest, longest  # n-gram sizes prompt lookup matches
        self.step_queries = step_queries  # drafts only fill a step up to this many queries

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    def lookup_for(self, row: Row) -> PromptLookup | None:
        """A new row's prompt lookup, if it may draft."""
        if not self.enabled or not row.may_speculate:
            return None
        return PromptLookup(self.shortest, self.longest)

    def draft(self, decoding: Sequence[Row]) -> int:
        """Set each decoding row's draft for this step (() for most), within the step's spare queries;
        returns how many tokens were drafted."""
        spare = self.step_queries - len(decoding)
        drafted = 0
        for row in decoding:
            row.draft = ()
            room = min(self.tokens, spare - drafted, row.draft_room)
            if row.lookup is not None and room > 0:
                row.draft = row.lookup.propose(row.tokens, room)
                drafted += len(row.draft)
        return drafted


def verified(samples: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a row takes from its step: `samples[i]` was sampled where the row's token i follows
    (after its last token and draft[:i]), so each stands while the draft agreed before it; the first
    sample that differs from the draft is the row's own next token, and the last one ends the row's
    step too when all of the draft stood."""
    agreed = 0
    while agreed < len(draft) and samples[agreed] == draft[agreed]:
        agreed += 1
    return list(samples[: agreed + 1])
