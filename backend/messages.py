"""The small typed messages that cross the queues between frontend and backend.

Everything here is plain data, picklable and free of torch, so that the
frontend can import it. The frontend puts `Submit`, `Cancel` and `Shutdown` on
the backend's inbox; the backend answers on its outbox with one `BackendReady`
(or `BackendFailed`) and then one `StepOutput` per decode step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]
# What of a request the backend refused as the request's own fault (Piece.invalid), named as in Submit and
# SamplingParams: no retry can mend it, so each API answers a 400 naming its own field for that part.
InvalidPart = Literal[
    "prompt_ids", "grammar", "logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words"
]

# A busy or idle backend sends a message (a StepOutput, empty if need be) at least this often, so
# that the frontend can tell a backend that stopped stepping from one with nothing to say.
HEARTBEAT_SECONDS = 1.0
SCORE = "score"  # SamplingParams.embedding of a score request: a pair for the --rerank-model
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_REPETITION_PENALTY = 10.0


def reserved_places(places: int) -> int:
    """Of a server's rows (or its rows and queue), how many no team may take while another team may
    come: one in eight (4 of the default 32 rows), enough for another team's few interactive streams,
    little of what a lone team may use (backend/engine/scheduler.py, inference_api/router.py)."""
    return places // 8 if places >= 8 else min(1, places - 1)


# Rows whose temperature is below this are greedy (vLLM's rule): logits / 1e-40 overflow to +inf, whose
# race the lowest such token won, not the most likely one (backend/layers/sampler.py).
GREEDY_BELOW = 1e-5


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

    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    max_tokens: int = 128  # 0 to score a prompt (prompt_logprobs) without generating; the APIs allow it
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # Log-probabilities, of the model's raw logits (before penalties, temperature and cuts): None
    # for none, N for the chosen token's and the N most likely alternatives' (at most MAX_LOGPROBS).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Penalties and filters, as vLLM and OpenAI define them (backend/layers/logits_processors.py).
    presence_penalty: float = 0.0  # -2..2, once for each token already generated
    frequency_penalty: float = 0.0  # -2..2, times how often it was generated
    repetition_penalty: float = 1.0  # > 0: logits of prompt and generated tokens divided (or times) by it
    min_p: float = 0.0  # 0..1: tokens below min_p times the top token's probability are cut
    # Locally typical sampling (Meister et al. 2022; TGI's, llama.cpp's and transformers' typical_p), in
    # (0, 1], 1 for no cut: of what the other cuts leave, the tokens whose surprise is nearest the
    # distribution's entropy, as many as make up this much of its probability (backend/layers/sampler.py)
    typical_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to its logit
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be generated (empty: any token)
    # vLLM's bad_words, as token ids: a sequence's last token is never generated right after the others
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0  # no EOS (nor stop_token_ids) before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # tokens that end generation, like EOS
    # Constrained decoding: an llguidance grammar (serialized; the frontend makes it from a JSON schema,
    # regex, choice or Lark grammar) that every generated token must follow (backend/layers/grammar.py)
    grammar: str | None = None
    # An embedding request (backend/model/embeddings.py): the prompt's hidden states pooled ("mean" or
    # "last") into one unit vector, sent as Piece.embedding; nothing is generated. "score": the prompt is
    # a (query, document) pair that the --rerank-model reads, and Piece.embedding is its one relevance logit
    embedding: str | None = None  # a pooling, or SCORE
    # A score request's: where the pair's second text begins (token type 1 from there on, as the rerank
    # model's tokenizer marks it); None: the tokenizer gives both texts one token type
    pair_start: int | None = None
    # Speculative decoding where the server has it on (backend/engine/speculation.py); False: a token a
    # step for this request. Either way the output is the same; only the time it takes changes.
    speculative: bool = True
    # OpenAI's Predicted Outputs: tokens the answer is expected to be, most of them (a file sent back edited),
    # drafted from where the answer stands in them (backend/engine/prediction.py) where the row drafts at
    # all. Like `speculative`, it changes when the answer comes, never what it is.
    prediction: tuple[int, ...] = ()
    # The text leaves special tokens (<|im_end|>, a template's markers) out; False keeps their text in it
    # (vLLM's skip_special_tokens), for a client that reads them.
    skip_special_tokens: bool = True
    # The stop string that ended the text ends it (vLLM's include_stop_str_in_output); by default it is cut.
    include_stop_str_in_output: bool = False
    # Each piece names the tokens it follows from (Piece.token_ids; vLLM's return_token_ids).
    token_ids: bool = False

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
        if self.max_tokens < 0:  # 0: the prompt is prefilled (and scored) and nothing generated
            raise InvalidParams("max_tokens", f"max_tokens must be >= 0, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidParams(name, f"{name} must be from 0 to {MAX_LOGPROBS}, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidParams(name, f"{name} must be from -2 to 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidParams(
                "repetition_penalty",
                f"repetition_penalty must be over 0 and at most {MAX_REPETITION_PENALTY:g}, "
                f"got {self.repetition_penalty}",
            )
        if not 0 <= self.min_p <= 1:
            raise InvalidParams("min_p", f"min_p must be from 0 to 1, got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise InvalidParams("typical_p", f"typical_p must be in (0, 1], got {self.typical_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
            not -100 <= bias <= 100 for _, bias in self.logit_bias
        ):
            raise InvalidParams(
                "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, each from -100 to 100"
            )
        if self.min_tokens < 0:
            raise InvalidParams("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name) and self.grammar is not None:
                # Both masks at once could leave no token at all: a step with nothing to sample.
                raise InvalidParams(name, f"{name} cannot be combined with a grammar")
        if any(not words for words in self.bad_words):
            raise InvalidParams("bad_words", "each of bad_words must be at least one token")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParams("stop", "stop sequences must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether its logits change before sampling (backend/layers/logits_processors.py)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.min_tokens
        )


@dataclass(frozen=True)
class BackendConfig:
    """What the backend process loads and how many rows it serves."""

    model: str | None = None  # None: the default model (SPEC §3)
    # A separate sentence-embedding model for /v1/embeddings (a directory or hub id that transformers'
    # AutoModel loads); None: the served model's own hidden states
    embedding_model: str | None = None
    # A cross-encoder for /v1/rerank (a directory or hub id that transformers'
    # AutoModelForSequenceClassification loads, with one label); None: no reranking
    rerank_model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto (float32 on a CPU, else dtype's) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: a GGUF file's own 4-bit weights (else none); none: float weights; int4 | int8: weight-only
    # quantization of the linear layers at load (loader.quantize_weights)
    quantize: str = "auto"
    rows: int = 32
    max_seq_len: int | None = None  # per-row capacity; None: min(model context, 2048)
    # Bytes the KV cache may take (--kv-cache-memory): without max_seq_len, the most positions a row that
    # fit in it; with max_seq_len, a bound that length must fit in (loader.pick_max_seq_len)
    kv_cache_memory: int | None = None
    # Prompt tokens a step prefills while rows decode, longer prompts a chunk a step; None: as many as
    # keep a step within 1.8 plain ones, measured as it runs (backend.engine.prefill_budget)
    max_prefill_tokens: int | None = None
    prefix_reuse: bool = True  # a prompt starting as a row's cached tokens prefills only the rest
    # Decode steps of few rows compiled by torch.compile (decoder_runner.DecoderRunner); start-up
    # compiles them, which takes minutes on a small CPU the first time
    compile_decode: bool = False
    # On a GPU, decode steps as CUDA graphs captured at start-up, one per bucket of rows and span
    # (backend.model.decode_graphs); off: eager steps
    cuda_graphs: bool = True
    cache_dir: str | None = None  # converted weights; None: $INFERENCE_CACHE_DIR or ~/.cache
    # Run a model's own configuration and tokenizer code (`auto_map`), as transformers' trust_remote_code:
    # code from the model's files, run as it is in the backend process. Its own modeling code is refused
    # whatever this says, or not run where transformers has classes of its type
    # (architectures.check_own_code).
    trust_remote_code: bool = False
    # CPU threads for torch; None: torch's default (every core). Fewer leaves cores to the HTTP
    # side: torch's threads wait for each other, so one descheduled thread stalls them all.
    torch_threads: int | None = None
    # Speculative decoding by prompt lookup (backend/engine/speculation.py): the most draft tokens a row
    # gets a step (0: off; None: on with a draft model or where the decode steps take a row's draft as
    # more queries, the CPU's loop, else off), and the sizes of the n-grams it matches, longest first.
    speculative_tokens: int | None = None
    # A small model of the served model's tokenizer whose greedy guesses are the drafts, in place of prompt
    # lookup (backend/engine/draft_model.py); a directory, GGUF file or hub id, loaded as `model` is
    draft_model: str | None = None
    # LoRA adapters served beside the model, rows of each in one step (backend/model/lora.py): (name, a
    # directory PEFT saved)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Adapters may be loaded and unloaded while the server runs (--allow-runtime-lora, vLLM's
    # /v1/load_lora_adapter): every linear layer is wrapped for them at start
    runtime_lora: bool = False
    # Adapters loaded while running, loaded again by a backend restarted after a crash; unlike
    # lora_modules, one that no longer loads is left out with an error in the log
    lora_modules_loaded: tuple[tuple[str, str], ...] = ()
    # The most adapters loaded at once (--max-loras) and the highest rank one may have (--max-lora-rank);
    # None: no limit
    max_loras: int | None = None
    max_lora_rank: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # The defaults of the sampling fields a request leaves out (backend/model/sampling_defaults.py): "auto"
    # the model's generation_config.json, "vllm" none (the APIs' own), else a directory's file; the
    # override's fields over them (--override-generation-config)
    generation_config: str = "auto"
    override_generation_config: tuple[tuple[str, float], ...] = ()
    mock: bool = False
    mock_tokens_per_second: float = 50.0
    # Tests only: the mock stops stepping for good at a prompt of this text (a hung backend).
    mock_stall_text: str | None = None


# Frontend -> backend


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Whose cached prefixes the request may reuse, and who may reuse the ones it leaves: the requests of
    # the same scope only (backend/engine/prefix_cache.py). The frontend makes it from the team the proxy
    # vouches for and the request's own cache_salt (inference_api/router.py, `cache_scope`).
    cache_scope: str = ""
    # The team the proxy vouches for ("" without one): rows are shared fairly between teams
    # (backend/engine/scheduler.py).
    team: str = ""
    # The LoRA adapter (--lora-modules) the request's `model` names; "": the base model.
    adapter: str = ""


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class LoadAdapter:
    """Load the LoRA adapter in `path` (a directory PEFT saved) under `name`, between two steps."""

    request_id: str
    name: str
    path: str
    replace: bool = False  # in place of an adapter of that name (vLLM's load_inplace)


@dataclass(frozen=True)
class UnloadAdapter:
    """Serve the adapter `name` no more: its waiting requests end with an error, its rows finish."""

    request_id: str
    name: str


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
    embedding_model: EmbeddingModelReady | None = None  # None: the served model embeds
    rerank_model: EmbeddingModelReady | None = None  # None: /v1/rerank is not served
    adapters: tuple[str, ...] = ()  # the LoRA adapters' names (--lora-modules), which requests' `model` names
    # The defaults of the sampling fields a request leaves out (BackendConfig.generation_config): vLLM's
    # names, max_tokens for max_new_tokens; empty: the APIs' own
    sampling_defaults: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EmbeddingModelReady:
    """A separate model beside the served one: the sentence-embedding model (`--embedding-model`) that
    answers /v1/embeddings, or the cross-encoder (`--rerank-model`) that answers /v1/rerank."""

    name: str  # what its requests' `model` names
    tokenizer_path: str  # a directory with its tokenizer.json, as BackendReady.tokenizer_path
    max_tokens: int  # the most tokens an input may have (its max_position_embeddings)
    vocab_size: int  # token ids its embedding takes


@dataclass(frozen=True)
class AdaptersChanged:
    """The answer to LoadAdapter or UnloadAdapter: the adapters served now, or why nothing changed."""

    request_id: str
    adapters: tuple[str, ...]
    error: str | None = None
    not_found: bool = False  # the error is an unknown adapter's (a 404)


@dataclass(frozen=True)
class BackendFailed:
    """The backend could not start (model not found, resources short...)."""

    message: str


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most likely tokens in its place."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int = 1  # among the vocabulary, as vLLM ranks: the tokens at least as likely, itself included


@dataclass
class Piece:
    """New text for one request; the last piece of a request has a finish_reason.

    With logprobs asked for, a piece carries an entry for each token generated
    since the last piece (text held back by a stop sequence included), so a
    request's entries number its completion tokens; its first piece carries
    the prompt's (None for the first prompt token, which nothing predicts).

    Not frozen, though nothing changes one once made: a frozen dataclass sets each field through
    object.__setattr__, and every row makes a piece every step. 32 of them took 230 µs on the 2-core
    EPYC, 70 plain: the H200's 32-row step of a 1B took 2.5 ms, 0.4 more than the GPU's work.
    """

    request_id: str
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # With SamplingParams.token_ids: the ids of the tokens generated since the last piece (text held
    # back by a stop sequence included, as the logprobs entries), so a request's add up to its tokens.
    token_ids: tuple[int, ...] = ()
    cached_tokens: int = 0  # prompt tokens not computed: their keys and values were in the cache
    # Seconds the request waited for a row, from its coming to the engine to its prefill's start (a row's
    # pieces; None for an answer that took no row: an embedding, a rejection)
    queued_seconds: float | None = None
    stop_sequence: str | None = None  # the stop string that ended the request (Anthropic's stop_sequence)
    stop_token_id: int | None = None  # the stop_token_ids token that ended the request (vLLM's stop_reason)
    embedding: tuple[float, ...] | None = None  # an embedding request's vector
    # With finish_reason "error": the part of the request at fault when the request itself is (a prompt
    # too long, a grammar no text can follow); None when the server failed it (a retry may succeed).
    invalid: InvalidPart | None = None
    # Speculative decoding, so far in the request: the draft tokens its steps checked, and those that stood.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Of those, the draft tokens taken from the request's prediction, and those of them that stood.
    predicted_tokens: int = 0
    accepted_predicted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutput:
    """Every piece of one decode step, sent as one message to keep queue traffic per step."""

    pieces: list[Piece]
    # Requests that took a row in this step: they have left the queue, though their first piece
    # may come steps later (a long prefill, text held back at the start of a stop sequence).
    admitted: list[str] = field(default_factory=list)

    def __reduce__(self) -> tuple:
        """Pickled as each piece's values in PIECE_FIELDS' order, not as an object of 19 named fields:
        a 32-row step's pickling took 100 µs in the backend and its unpickling 160-186 in the router
        thread, 44-52 and 127-133 so (the 2-core EPYC)."""
        return step_output, ([piece_values(piece) for piece in self.pieces], self.admitted)


PIECE_FIELDS = tuple(piece_field.name for piece_field in fields(Piece))
piece_values = operator.attrgetter(*PIECE_FIELDS)


def step_output(values: list[tuple], admitted: list[str]) -> StepOutput:
    """A StepOutput from its pickled form (StepOutput.__reduce__)."""
    pieces = []
    for one in values:
        piece = object.__new__(Piece)
        piece.__dict__.update(zip(PIECE_FIELDS, one, strict=True))
        pieces.append(piece)
    return StepOutput(pieces, admitted)
