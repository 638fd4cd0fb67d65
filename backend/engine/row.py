"""One user row: the request it serves and where its generation stands."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from backend.engine.detokenizer import Decoder, IncrementalDetokenizer
from backend.engine.prediction import Prediction
from backend.engine.prompt_lookup import PromptLookup
from backend.engine.stop_matcher import StopMatcher
from backend.messages import FinishReason, InvalidPart, Piece, Submit, TokenLogprob


@dataclass
class Row:
    index: int
    request: Submit
    tokenizer: Decoder
    eos_ids: frozenset[int]
    max_seq_len: int
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in this row of the cache
    queued: float = 0.0  # seconds from the request's coming to the engine to this row (Piece.queued_seconds)
    chunk_end: int = 0  # while prefilling: where this step's chunk of the prompt ends
    as_queries: bool = False  # this step's chunk as decode queries of the row (engine._prompts_as_queries)
    cancelled: bool = False
    spoke: bool = False  # a piece of it has gone out
    told: int = 0  # generated tokens whose ids a piece carried (SamplingParams.token_ids)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop_token_ids token that ended it (Piece.stop_token_id)
    # Log-probabilities not yet sent: the prompt's (set at prefill), the tokens' since the last piece.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # of the chunks so far
    # Speculative decoding (speculation.py): the row's prompt lookup where it may draft, this step's draft;
    # so far, the draft tokens it was given and those that stood; and, fading with every step (`forget`),
    # the draft tokens that stood and the drafts that did not stand whole, which `draft_acceptance` reads.
    lookup: PromptLookup | None = None
    draft: tuple[int, ...] = ()
    drafted: int = 0
    accepted_drafts: int = 0
    recently_stood: float = 0.0
    recently_missed: float = 0.0
    # The request's prediction where it may draft (prediction.py); whether this step's draft came from it;
    # so far, the draft tokens it gave and those that stood.
    prediction: Prediction | None = None
    draft_predicted: bool = False
    predicted: int = 0
    accepted_predicted: int = 0
    # steps since the row last drafted (speculation.PROBE_AFTER); a new row never did: as if forever
    undrafted_steps: float = math.inf

    def __post_init__(self) -> None:
        self.reused = self.cached  # prompt tokens found in the cache at admission (prefix_cache)
        params = self.request.params
        self.detokenizer = IncrementalDetokenizer(
            self.tokenizer, self.request.prompt_ids, params.skip_special_tokens
        )
        self.stop = StopMatcher(params.stop, params.include_stop_str_in_output)
        # The sampler hashes (seed, tokens generated so far) into each draw (sampler.uniform).
        self.seed = params.seed % 2**63 if params.seed is not None else secrets.randbits(63)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """The tokens whose keys and values this row of the cache holds, in order."""
        return self.tokens[: self.cached]

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt and the tokens generated so far."""
        return (*self.prompt_ids, *self.generated)

    @property
    def prefix(self) -> tuple[str, tuple[int, ...]]:
        """What another request of the same cache scope may reuse of this row (prefix_cache.py)."""
        return self.request.cache_scope, self.cached_tokens

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is in the cache (a long one takes a chunk a step)."""
        return self.cached >= len(self.prompt_ids)

    @property
    def next_input(self) -> int:
        """The token the next decode step feeds: the last one sampled."""
        return self.generated[-1]

    @property
    def position(self) -> int:
        """Where the next decode step writes in the cache: never the row's last position, which a row
        ends before it reaches (`accept` ends it at max_seq_len tokens, and its last token is never fed
        back). On a GPU the decode graphs' padding queries write there, and nothing may read it
        (model/decode_graphs.py, `padding_position`): a step there is refused, not run."""
        if self.cached >= self.max_seq_len - 1:
            raise RuntimeError(
                f"row {self.index} would decode at position {self.cached}, its last or past it"
            )
        return self.cached

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def unheard(self) -> bool:
        """Whether its first token released no text (a part of a character, the start of a stop
        sequence): its client has seen nothing yet."""
        return len(self.generated) == 1 and not self.spoke

    @property
    def scores_prompt(self) -> bool:
        """Whether the request asks for its prompt tokens' logprobs (every prompt position's logits)."""
        return self.request.params.prompt_logprobs is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    @property
    def may_speculate(self) -> bool:
        """Whether the row may take drafts: it asked, and nothing of its sampling depends on the tokens
        before each position (the logits processors count them a token a step, a grammar's mask follows
        them)."""
        params = self.request.params
        return params.speculative and not params.penalized and params.grammar is None

    @property
    def draft_acceptance(self) -> float:
        """The chance that a draft token stands once those before it did, from the row's recent drafts:
        stood / (stood + misses), from one half (a prior of one of each)."""
        return (self.recently_stood + 1) / (self.recently_stood + self.recently_missed + 2)

    def took_draft(self, stood: int) -> None:
        """This step's draft was verified: `stood` of its tokens stood."""
        self.drafted += len(self.draft)
        self.accepted_drafts += stood
        if self.draft_predicted:
            self.predicted += len(self.draft)
            self.accepted_predicted += stood
        self.recently_stood += stood
        self.recently_missed += stood < len(self.draft)

    def forget(self, kept: float) -> None:
        """Let the drafts so far weigh less (a row whose drafts missed tries again now and then: its
        text may come to repeat itself)."""
        self.recently_stood *= kept
        self.recently_missed *= kept

    @property
    def draft_room(self) -> int:
        """The longest draft the row can use: its step takes at most the draft and one more token, and
        writes keys and values up to the draft's last position, which must be before the row's last."""
        left = self.request.params.max_tokens - len(self.generated) - 1
        return max(0, min(left, self.max_seq_len - 2 - self.cached))

    def accept(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None = None,
        complete: bool = False,
    ) -> Piece | None:
        """Take the tokens the step gave the row (one, or those a draft verified), in order, up to the
        one that ends it; return the text they release and, at the end, why it ended. `complete`: the
        row's grammar allows nothing after the last token (backend/layers/grammar.py)."""
        text = ""
        for i, token_id in enumerate(tokens):
            text += self._take(token_id, logprobs[i] if logprobs else None)
            if self.finished:
                return self._piece(text)
            if complete and i == len(tokens) - 1:
                return self._finish("stop", text + self.stop.flush())
            if self._at_length:
                return self._finish("length", text + self.stop.flush())
        return self._piece(text) if text else None

    def _take(self, token_id: int, logprob: TokenLogprob | None) -> str:
        """One token: the text it releases; at an end token or a stop sequence, the row ends."""
        params = self.request.params
        self.generated.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        ends = token_id in self.eos_ids and not params.ignore_eos
        if ends or token_id in params.stop_token_ids:
            self.finish_reason = "stop"
            self.stop_token_id = None if ends else token_id  # an end token is no stop token (stop_reason)
            return self.stop.flush()
        text = self.stop.feed(self.detokenizer.add(token_id))
        if self.stop.stopped:
            self.finish_reason = "stop"
        return text

    @property
    def _at_length(self) -> bool:
        params = self.request.params
        return (
            len(self.generated) >= params.max_tokens
            or len(self.prompt_ids) + len(self.generated) >= self.max_seq_len
        )

    def cancel_piece(self) -> Piece:
        return self._finish("cancelled", "")

    def error_piece(self, message: str, invalid: InvalidPart | None = None) -> Piece:
        """The end of a request whose step failed (see Engine._step_rows), or, with `invalid`, whose own
        part could not go on (a grammar with no way on)."""
        self.finish_reason = "error"
        return replace(self._piece(""), error=message, invalid=invalid)

    def scored_piece(self) -> Piece:
        """The end of a request that only scores its prompt (max_tokens 0)."""
        return self._finish("length", "")

    def _finish(self, reason: FinishReason, text: str) -> Piece:
        self.finish_reason = reason
        return self._piece(text)

    def _new_token_ids(self) -> tuple[int, ...]:
        """The tokens generated since the last piece, when the request asks for its ids."""
        if not self.request.params.token_ids:
            return ()
        new, self.told = tuple(self.generated[self.told :]), len(self.generated)
        return new

    def _piece(self, text: str) -> Piece:
        piece = Piece(
            self.request.request_id,
            text,
            self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.generated),
            logprobs=tuple(self.pending_logprobs),
            prompt_logprobs=self.prompt_logprobs,
            token_ids=self._new_token_ids(),
            cached_tokens=self.reused,
            queued_seconds=self.queued,
            stop_sequence=self.stop.matched,
            stop_token_id=self.stop_token_id,
            draft_tokens=self.drafted,
            accepted_draft_tokens=self.accepted_drafts,
            predicted_tokens=self.predicted,
            accepted_predicted_tokens=self.accepted_predicted,
        )
        self.pending_logprobs.clear()
        self.prompt_logprobs = None  # sent once, with the first piece
        self.spoke = True
        return piece
