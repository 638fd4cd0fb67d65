"""A decode step launched before the last one's tokens are read, so that the host's work of a step runs
while the device computes the next one (vLLM's asynchronous scheduling; issue 41).

Where decode steps are CUDA graphs, a step keeps the GPU busy for only part of its time: the
rest is the host reading the sampled tokens, taking them into the rows (text, stop sequences),
then scheduling and packing the next step, while the GPU waits (an H100 trial: a 1B Llama's
32-row step busy 2.3 ms of 3.6-4.2). So when every row of a decode step will surely decode again
in the next one, the engine launches that next step before it reads this one's tokens: its input
tokens are the ones just sampled, still on the device, its positions one further. Then it reads
and takes this step's tokens while the GPU runs the next, and at its next `step()` launches the
one after before reading that.

A row "surely decodes again" unless its unread token could end it by length (max_tokens, the
context), and it samples plainly: no penalties or grammar (their counts and masks follow the
tokens on the host), no logprobs or draft. A token that does end it (an end-of-sequence token, a
stop sequence) is read a step late: the row ends as ever, and the token the step ahead sampled
for it is dropped, as are those of rows cancelled meanwhile. A step with a prompt chunk, a
request that could take a free row, or embeddings to run goes back to plain steps, as does a
step ahead that cannot be launched. The tokens are the same as plain steps': the step ahead is
the step the row would have run, with its own draw number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backend.engine.row import Row


@dataclass(frozen=True)
class NextStepRow:
    """A decoding row as the step after its unread token sees it (step_inputs.DecodingRow): one
    position further; its input, the unread token, comes from the device."""

    index: int
    position: int
    next_input: int = 0  # a stand-in: the step ahead's input tokens are replaced by the sampled ones
    draft: tuple[int, ...] = ()


@dataclass
class StepAhead:
    """A decode step launched before the last one's tokens were read."""

    rows: list[Row]  # in the step's order
    drawn: torch.Tensor  # [rows] its sampled tokens on the device (NOT_FINITE where due)
    read: Callable[[], list[int]]  # the same on the host, waiting for this step alone


def decodes_again(row: Row) -> bool:
    """Whether the row surely decodes in the step after the one whose token it has not read yet, and
    plainly enough to be launched before it is read (see the module's docstring)."""
    params = row.request.params
    taken = len(row.generated) + 1  # with the unread token
    return (
        not row.cancelled
        and not row.draft
        and not params.penalized
        and params.grammar is None
        and params.logprobs is None
        and taken < params.max_tokens
        and len(row.prompt_ids) + taken < row.max_seq_len
    )


def next_step_rows(rows: list[Row]) -> list[NextStepRow]:
    """The rows as the step ahead feeds them: each one position past its unread token's."""
    return [NextStepRow(row.index, row.position + 1) for row in rows]
