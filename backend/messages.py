"""The small typed messages that cross the queues between frontend and backend.

Everything here is plain data, picklable and free of torch, so that the
frontend can import it. The frontend puts `Submit`, `Cancel` and `Shutdown` on
the backend's inbox; the backend answers on its outbox with one `BackendReady`
(or `BackendFailed`) and then one `StepOutput` per decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


class InvalidParams(ValueError):
    """A sampling parameter out of its range; `param` names it for the client."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it ends.

    The defaults are the neutral ones (no top-k or top-p cut); each API layer
    applies its own documented defaults before building this.
    """

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not self.temperature >= 0:
            raise InvalidParams("temperature", f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidParams("top_k", f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidParams("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InvalidParams("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParams("stop", "stop sequences must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class BackendConfig:
    """What the backend process loads and how many rows it serves."""

    model: str | None = None  # None: the default model (SPEC §3)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: a GGUF file's own 4-bit weights (else none); none: float weights; int4 | int8: weight-only
    # quantization of the linear layers at load (loader.quantize_weights)
    quantize: str = "auto"
    rows: int = 32
    max_seq_len: int | None = None  # per-row capacity; None: min(model context, 2048)
    cache_dir: str | None = None  # converted weights; None: $INFERENCE_CACHE_DIR or ~/.cache
    # CPU threads for torch; None: torch's default (every core). Fewer leaves cores to the HTTP
    # side: torch's threads wait for each other, so one descheduled thread stalls them all.
    torch_threads: int | None = None
    mock: bool = False
    mock_tokens_per_second: float = 50.0


# Frontend -> backend


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


# Backend -> frontend


@dataclass(frozen=True)
class BackendReady:
    model_name: str
    rows: int
    max_seq_len: int  # prompt + generated tokens must fit in this
    tokenizer_path: str | None  # a directory AutoTokenizer loads; None for the mock
    device: str
    dtype: str
    vocab_size: int | None = None  # token ids the model's embedding takes; None for the mock


@dataclass(frozen=True)
class BackendFailed:
    """The backend could not start (model not found, resources short...)."""

    message: str


@dataclass(frozen=True)
class Piece:
    """New text for one request; the last piece of a request has a finish_reason."""

    request_id: str
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutput:
    """Every piece of one decode step, sent as one message to keep queue traffic per step."""

    pieces: list[Piece]
