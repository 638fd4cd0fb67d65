"""Constrained decoding: rows whose output must follow a grammar (JSON Schema, regex, choice, Lark).

A request carries its grammar as llguidance's serialized form (the frontend
builds it from `response_format` and friends, and refuses what llguidance
cannot do). Each constrained row gets a matcher; each step, once the model's
forward pass is launched, the matchers compute the bitmask of tokens their
rows may take next, the sampler sees the masked tokens at -inf, and each
row's matcher then consumes the token it drew. Unconstrained rows in the same
step pay nothing.

Where the forward pass runs decides how the masks are computed. On a GPU it
is launched and the host is free until the logits are read: the masks are
computed meanwhile, in llguidance's threads. On a CPU the forward pass's
threads hold every core, and each of its parallel regions waits for the
slowest of them: masks computed beside the pass in another thread took a
core from it, and 32 rows of the benchmark's JSON schema cost 4-5 ms a step
that way, against 2.0-2.2 ms computed one row after another in the engine's
thread once the pass is done (docs/performance.md).

llguidance rather than xgrammar, by measurement on the default model
(docs/backend.md): llguidance refuses a schema keyword it cannot enforce
(`uniqueItems`, `not`, `if`/`then`: "Unimplemented keys: [...]") where
xgrammar compiles the schema without it and lets anything through there;
its mask takes about 12 µs a token (xgrammar: 1), which a step of tens of
milliseconds barely notices, and it needs no other package (xgrammar
brings triton).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from backend.kernels.extension import extension

# llguidance's default limits; errors without the parser's state and the whole grammar, which would
# make a request's error message pages long.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A grammar the matcher could not start from, or a token it could not take."""


class Masks:
    """The token masks of one step's constrained rows."""

    def __init__(self, rows: dict[int, int], bitmask: torch.Tensor):
        self.rows = rows  # row index -> its line in `bitmask`
        self.bitmask = bitmask

    @property
    def constrains(self) -> bool:
        return bool(self.rows)

    def apply(self, logits: torch.Tensor, row_indexes: list[int]) -> None:
        """Set to -inf, in place, what each constrained row may not take; logits[i] is row_indexes[i]'s."""
        lines = [self.rows.get(row, -1) for row in row_indexes]
        if all(line < 0 for line in lines):
            return
        loop = _mask_loop(logits)
        if loop is not None:
            loop(logits, self.bitmask, torch.tensor(lines))
            return
        positions = torch.tensor([i for i, line in enumerate(lines) if line >= 0], device=logits.device)
        words = self.bitmask[[line for line in lines if line >= 0]].to(logits.device)  # [rows, vocab / 32]
        # Each byte of the words (little-endian: token 8b + t is bit t of byte b) looked up as its 8 bits.
        allowed = BYTE_BITS.to(logits.device)[words.view(torch.uint8).long()].reshape(len(positions), -1)
        kept = logits[positions].masked_fill(~allowed[:, : logits.shape[1]], float("-inf"))
        logits[positions] = kept


# Bit t of each byte value b, as bools: [256, 8].
BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def _mask_loop(logits: torch.Tensor) -> Callable | None:
    """The fused operations' loop (fused_ops.cpp, `mask_disallowed`) for float32 logits on a CPU: it
    skips each word of allowed tokens where PyTorch's operations unpack every bit, some 3 ms of a 32-row
    step of the default model (docs/performance.md). None elsewhere, and where the extension is not
    built."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    built = extension()
    return None if built is None else built.mask_disallowed


NO_MASKS = Masks({}, torch.empty(0))  # a step without a constrained row


class Grammars:
    """The matchers of the constrained rows."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: frozenset[int], rows: int
    ):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.rows = rows
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        self._tokenizer: llguidance.LLTokenizer | None = None  # made at start (`make_tokenizer`) or first use
        self._tokenizer_error: str | None = None  # why it cannot be made, once tried
        self._tokenizer_made = threading.Lock()  # grammars compile in threads (engine/grammar_builds.py)
        self._executor: llguidance.LLExecutor | None = None  # its threads, while a GPU runs the pass
        self._bitmask: torch.Tensor | None = None

    def matcher(self, grammar: str | None) -> llguidance.LLMatcher | None:
        """A matcher at the start of this grammar (None for none); GrammarError if it cannot be used, or if
        no text can follow it (as `[^\\s\\S]`, or a rule that never ends: a row would stop at once as if
        it were met). Safe to call from several threads at once."""
        if grammar is None:
            return None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        # llguidance finds a dead start when it computes the first mask: the matcher turns to an error
        # and the mask allows only EOS, as if the grammar were complete.
        first = matcher.compute_bitmask()
        if matcher.is_error() or not (any(first) or matcher.is_accepting()):
            raise GrammarError(
                "no text can follow the grammar: it allows no token at its start and is not complete "
                f"({_reason(matcher)})"
            )
        return matcher

    def attach(self, row: int, matcher: llguidance.LLMatcher | None) -> None:
        """The row's new request follows this matcher's grammar (None: no grammar)."""
        self.matchers.pop(row, None)
        if matcher is not None:
            self.matchers[row] = matcher

    def release(self, row: int) -> None:
        self.matchers.pop(row, None)

    def masks(self, row_indexes: list[int], device: torch.device) -> Masks:
        """The masks of the constrained rows among these (those about to sample), for a forward pass on
        `device`, launched already: on a GPU in llguidance's threads while the pass runs, on a CPU one
        row after another in this thread, once its threads are done (the module's docstring says why)."""
        lines = {row: line for line, row in enumerate(r for r in row_indexes if r in self.matchers)}
        if not lines:
            return NO_MASKS
        if self._bitmask is None:
            # Pinned where a GPU will read it. (llguidance.torch has these few lines too, but importing it
            # compiles a function with torch.compile, which we never call: 1.1 s of every start.)
            words = (self.vocab_size + 31) // 32
            pinned = torch.cuda.is_available()
            self._bitmask = torch.full((self.rows, words), -1, dtype=torch.int32, pin_memory=pinned)
        work = [(self.matchers[row], line) for row, line in lines.items()]
        line_bytes = self._bitmask.shape[1] * self._bitmask.element_size()
        if device.type == "cpu":
            for matcher, line in work:
                matcher.unsafe_compute_mask_ptr(self._bitmask[line].data_ptr(), line_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(work, self._bitmask.data_ptr(), line_bytes, self.rows)
        return Masks(lines, self._bitmask)

    def consume(self, row: int, token: int) -> bool:
        """The row drew this token; whether its grammar is now complete (it allows nothing more).

        GrammarError if the grammar has no way on from the text so far (its matcher turned to an error
        when it computed this step's mask, which then allowed only EOS: taken, the row would stop as if
        its grammar were met), or if it does not allow the token (a row whose every allowed token another
        setting had cut, such as min_tokens against a grammar that must end)."""
        matcher = self.matchers.get(row)
        if matcher is None:
            return False
        if matcher.is_error():
            raise GrammarError(
                f"the grammar allows no token after the text so far, and is not complete ({_reason(matcher)})"
            )
        if not matcher.consume_token(token):
            raise GrammarError(f"the grammar does not allow token {token}: {_reason(matcher)}")
        return matcher.is_stopped()

    def make_tokenizer(self) -> None:
        """Make llguidance's view of the tokenizer now, where it can be made (else each grammar's request
        is refused with the reason). It takes 0.5 s on the default model's 49,152 tokens, 0.35 s of it
        holding the GIL in llguidance's constructor: made at the first grammar, in a build's thread, it
        stalled every row's step for as long, so a server makes it as soon as it is ready (serve.py)."""
        try:
            self._llg_tokenizer()
        except GrammarError as error:
            log.warning("%s", error)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer; GrammarError where it cannot make one (a tokenizer with
        more tokens than the model's vocabulary), which refuses the request, not the backend's work."""
        with self._tokenizer_made:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids)
                    )
                except ValueError as error:
                    self._tokenizer_error = f"this model's tokenizer cannot be used for grammars: {error}"
            if self._tokenizer_error is not None:
                raise GrammarError(self._tokenizer_error)
            return self._tokenizer


def _reason(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, without the marker its non-verbose errors end with."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()
