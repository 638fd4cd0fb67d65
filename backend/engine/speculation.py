"""Speculative decoding: several of a row's tokens from one read of the weights.

A decode step of one row reads every weight to make one token; the same
read can score a few more. Each step, `Speculator.draft` gives rows a
draft, the tokens prompt lookup guesses will follow (prompt_lookup.py)
or, with `--draft-model`, a small model's guesses (draft_model.py);
before either, where the request sent a prediction of its answer (OpenAI's
Predicted Outputs), the prediction's tokens from where the answer stands in
it (prediction.py). The step feeds each such row [its last token, draft...]
at consecutive positions: on a CPU as more decode queries of the same row,
each reading its row up to its own position, elsewhere as a chunk of the
row, as a prompt's next chunk runs (model/step_inputs.py). Every position's logits
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
with nothing that depends on the tokens before each position (penalties
and `min_tokens` count them, and `logit_bias` is applied by the same
processors, whose counts advance a token a step; a grammar's mask follows
them): those rows decode a token a step, as before. And how long a draft is: a
draft token costs its step about `DRAFT_TOKEN_COST` of a one-row step (on
a CPU a query is arithmetic as well as a read of the weights), which slows
every row of the step, and stands with a probability the row's own drafts
so far estimate (the i-th of a draft with about a**i). `draft_length` takes
the tokens whose chance of standing is worth their share of the step: long
drafts for a row copying its prompt at one stream, none for free text in a
full step (docs/backend.md has the measurements).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from backend.engine.draft_model import DraftModel, Guessing
from backend.engine.prediction import Prediction
from backend.engine.prompt_lookup import PromptLookup

if TYPE_CHECKING:
    from backend.engine.row import Row

# The most draft tokens a row gets a step by default.
DRAFT_TOKENS = 8
# What a draft token adds to a step, as a share of a one-row step's time: on the default model on a 2-core
# AVX2 CPU a one-row step took 24 ms and each more query of its row 4 to 6 ms (docs/backend.md).
DRAFT_TOKEN_COST = 0.2
# A row that drafts nothing for this many steps, and one that never drafted, drafts one token: a probe. Its
# record starts at one half, and where a token's share of the step is that much or more (a draft model
# whose guess costs half a step, prompt lookup in a full step) no draft would ever be tried, however
# well it would have fared: the probes let a row learn that its drafts stand (a probe that misses costs
# its share of one step in PROBE_AFTER).
PROBE_AFTER = 32
# A request's prediction is its client's word that the answer is mostly those tokens: its row starts as though
# this many draft tokens had stood (a record of 17 in 18), so that it drafts them in a busy step too (three
# tokens a step beside 15 other rows, eight beside 3), where a row's prior of one half would not draft at
# all. A prediction that misses has the record fall as any row's does, by a miss a draft.
PREDICTED_STOOD = 16.0
# How much of a row's draft record each step keeps: half of it after some 30 steps, so that a row whose drafts
# missed (free text) drafts again a token or two now and then, and takes long drafts if its text comes to
# repeat itself.
KEPT_A_STEP = 0.977


class Speculator:
    """Gives a step's decoding rows their drafts (each row keeps its own record of how they fared)."""

    def __init__(
        self,
        tokens: int,
        shortest: int,
        longest: int,
        step_queries: int,
        draft_model: DraftModel | None = None,
        draft_model_cost: float = 0.0,
    ):
        if tokens and not 1 <= shortest <= longest:
            raise ValueError(
                f"prompt lookup's shortest n-gram ({shortest}, --prompt-lookup-min) must be from 1 to its "
                f"longest ({longest}, --prompt-lookup-max)"
            )
        self.tokens = tokens  # the longest draft a row gets; 0: speculation is off
        self.shortest, self.longest = shortest, longest  # n-gram sizes prompt lookup matches
        self.step_queries = step_queries  # the most queries a step may have (the step plan's rows)
        # None: drafts by prompt lookup; else the draft model's guesses (draft_model.py), each of which
        # costs its pass too, `draft_model_cost` of a one-row step
        self.draft_model = draft_model
        self.cost = DRAFT_TOKEN_COST + draft_model_cost

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    def lookup_for(self, row: Row) -> PromptLookup | None:
        """A new row's prompt lookup, if it may draft (with a draft model, rows draft without one)."""
        if not self.enabled or not row.may_speculate or self.draft_model is not None:
            return None
        return PromptLookup(self.shortest, self.longest)

    def admit(self, row: Row) -> None:
        """Give a new row what it drafts from: its prompt lookup, and its request's prediction
        (prediction.py) where it sent one, whose drafts come before prompt lookup's or a draft model's;
        such a row starts with a record of PREDICTED_STOOD tokens that stood."""
        row.lookup = self.lookup_for(row)
        predicted = row.request.params.prediction
        if self.enabled and row.may_speculate and predicted:
            row.prediction = Prediction(predicted, self.shortest, self.longest)
            row.recently_stood = PREDICTED_STOOD

    def draft(self, decoding: Sequence[Row]) -> int:
        """Set each decoding row's draft for this step (() for most), as long as it pays and the step's
        spare queries allow; returns how many tokens were drafted."""
        spare, drafted, guessing = self.step_queries - len(decoding), 0, []
        share = self.token_share(len(decoding))
        for row in decoding:
            row.draft, row.draft_predicted = (), False
            row.forget(KEPT_A_STEP)
            room = min(self.tokens, spare - drafted, row.draft_room)
            drafts = row.lookup is not None or (self.draft_model is not None and row.may_speculate)
            length = self._length(row, share, room) if drafts and room > 0 else 0
            predicted = row.prediction.propose(row.generated, length) if length and row.prediction else ()
            if predicted:
                row.draft, row.draft_predicted = predicted, True
                drafted += len(predicted)
            elif length and self.draft_model is not None:
                guessing.append((row, Guessing(row.index, row.tokens, length)))
                drafted += length  # the room it takes, whatever the guesses come to
            elif length:
                row.draft = row.lookup.propose(row.tokens, length)
                drafted += len(row.draft)
        if guessing:
            guesses = self.draft_model.propose([wanted for _, wanted in guessing])
            for (row, _), draft in zip(guessing, guesses, strict=True):
                row.draft = draft
            drafted = sum(len(row.draft) for row in decoding)
        return drafted

    @staticmethod
    def _length(row: Row, share: float, room: int) -> int:
        """How long a draft the row gets: as long as its record pays for, else a probe of one token if it
        has not drafted for PROBE_AFTER steps; counts the row's steps without one."""
        length = draft_length(row.draft_acceptance, share, room)
        if not length and row.undrafted_steps >= PROBE_AFTER:
            length = 1
        row.undrafted_steps = 0 if length else row.undrafted_steps + 1
        return length

    def token_share(self, rows: int) -> float:
        """What a draft token costs, in tokens of a step of `rows` rows: the step makes one token a row in
        1 + cost * (rows - 1) one-row steps' time, and a draft token adds `cost` to it."""
        return rows * self.cost / (1 + self.cost * (rows - 1))


def draft_length(acceptance: float, share: float, most: int) -> int:
    """How many draft tokens pay: the i-th stands with about acceptance**i (each only if those before it
    did), and is worth its `share` of the step while that chance is over it."""
    length, chance = 0, acceptance
    while length < most and chance > share:
        length, chance = length + 1, chance * acceptance
    return length


def verified(samples: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a row takes from its step: `samples[i]` was sampled where the row's token i follows
    (after its last token and draft[:i]), so each stands while the draft agreed before it; the first
    sample that differs from the draft is the row's own next token, and the last one ends the row's
    step too when all of the draft stood."""
    agreed = 0
    while agreed < len(draft) and samples[agreed] == draft[agreed]:
        agreed += 1
    return list(samples[: agreed + 1])
