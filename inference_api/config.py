"""What the API server runs with, and how it travels from the command line to the gunicorn worker.

`python -m inference_api` turns its options into INFERENCE_* environment
variables and execs gunicorn; gunicorn.conf.py and the app factory in the
worker read them back with `ServerConfig.from_env()`. The environment is the
one channel that survives the exec and the fork.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from backend.messages import BackendConfig
from backend.model.sampling_defaults import checked

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_STEP_TIMEOUT = 60.0  # seconds: far past any one step, even a 2,048-token prefill on a small CPU


@dataclass(frozen=True)
class ServerConfig:
    backend: BackendConfig = field(default_factory=BackendConfig)
    max_queue: int = DEFAULT_MAX_QUEUE  # requests that may wait for a row; past that, 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # past that, 413
    host: str = "127.0.0.1"  # internal by default: only the proxy should face clients (SPEC §6)
    port: int = DEFAULT_PORT
    restart_delay: float = 1.0  # seconds between a backend's death and its restart, against crash loops
    # A backend that sends nothing (not even its heartbeat) for this long is hung: killed and restarted.
    step_timeout: float = DEFAULT_STEP_TIMEOUT
    # Under gunicorn a backend that cannot start ends the worker with gunicorn's "app failed to load"
    # code, so the whole server exits with the backend's message instead of retrying for ever.
    exit_on_backend_failure: bool = False
    embedding_pooling: str = "mean"  # /v1/embeddings: the mean of the tokens' hidden states, or the last's
    # --served-model-name (vLLM's): the names requests may give the model, the first the one responses
    # report; () serves it under the backend's own name (the model directory's, the hub id, "mock")
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None  # --chat-template: a Jinja file used instead of the model's template
    reasoning_parser: str = "auto"  # --reasoning-parser: how chat answers' thoughts are read (reasoning.py)
    tool_call_parser: str = "auto"  # --tool-call-parser: how chat answers' calls are read (tool_calls.py)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerConfig:
        env = os.environ if environ is None else environ
        backend = BackendConfig(
            model=env.get("INFERENCE_MODEL") or None,
            embedding_model=env.get("INFERENCE_EMBEDDING_MODEL") or None,
            rerank_model=env.get("INFERENCE_RERANK_MODEL") or None,
            dtype=env.get("INFERENCE_DTYPE", "auto"),
            kv_cache_dtype=env.get("INFERENCE_KV_CACHE_DTYPE", "auto"),
            device=env.get("INFERENCE_DEVICE", "auto"),
            quantize=env.get("INFERENCE_QUANTIZE", "auto"),
            rows=_int(env, "INFERENCE_ROWS", 32),
            max_seq_len=_int(env, "INFERENCE_MAX_SEQ_LEN", 0) or None,
            kv_cache_memory=_size(env, "INFERENCE_KV_CACHE_MEMORY"),
            max_prefill_tokens=_int(env, "INFERENCE_MAX_PREFILL_TOKENS", 0) or None,
            prefix_reuse=env.get("INFERENCE_PREFIX_REUSE", "1") != "0",
            compile_decode=_bool(env, "INFERENCE_COMPILE"),
            trust_remote_code=_bool(env, "INFERENCE_TRUST_REMOTE_CODE"),
            cuda_graphs=env.get("INFERENCE_CUDA_GRAPHS", "1") != "0",
            torch_threads=_int(env, "INFERENCE_TORCH_THREADS", 0) or None,
            # "" (or unset): speculative decoding where it pays (BackendConfig.speculative_tokens None)
            speculative_tokens=_int(env, "INFERENCE_SPECULATIVE_TOKENS", None),
            draft_model=env.get("INFERENCE_DRAFT_MODEL") or None,
            prompt_lookup_min=_int(env, "INFERENCE_PROMPT_LOOKUP_MIN", 2),
            prompt_lookup_max=_int(env, "INFERENCE_PROMPT_LOOKUP_MAX", 4),
            lora_modules=_lora_modules(env, "INFERENCE_LORA_MODULES"),
            runtime_lora=_bool(env, "INFERENCE_ALLOW_RUNTIME_LORA"),
            max_loras=_int(env, "INFERENCE_MAX_LORAS", 0) or None,
            max_lora_rank=_int(env, "INFERENCE_MAX_LORA_RANK", 0) or None,
            generation_config=env.get("INFERENCE_GENERATION_CONFIG") or "auto",
            override_generation_config=_generation_override(env, "INFERENCE_OVERRIDE_GENERATION_CONFIG"),
            mock=_bool(env, "INFERENCE_MOCK"),
            mock_tokens_per_second=float(env.get("INFERENCE_MOCK_TOKENS_PER_SECOND", "50")),
            mock_stall_text=env.get("INFERENCE_MOCK_STALL_TEXT") or None,
        )
        return cls(
            backend=backend,
            max_queue=_int(env, "INFERENCE_MAX_QUEUE", DEFAULT_MAX_QUEUE),
            max_body_bytes=_int(env, "INFERENCE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
            host=env.get("INFERENCE_HOST", "127.0.0.1"),
            port=_int(env, "INFERENCE_PORT", DEFAULT_PORT),
            restart_delay=float(env.get("INFERENCE_RESTART_DELAY", "1.0")),
            step_timeout=float(env.get("INFERENCE_STEP_TIMEOUT", repr(DEFAULT_STEP_TIMEOUT))),
            exit_on_backend_failure=_bool(env, "INFERENCE_EXIT_ON_BACKEND_FAILURE"),
            embedding_pooling=env.get("INFERENCE_EMBEDDING_POOLING", "mean"),
            served_model_names=tuple(env.get("INFERENCE_SERVED_MODEL_NAME", "").split()),
            chat_template=env.get("INFERENCE_CHAT_TEMPLATE") or None,
            reasoning_parser=env.get("INFERENCE_REASONING_PARSER") or "auto",
            tool_call_parser=env.get("INFERENCE_TOOL_CALL_PARSER") or "auto",
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that `from_env` reads back into this config.

        exit_on_backend_failure is left out: gunicorn.conf.py sets it, as it belongs to gunicorn.
        """
        b = self.backend
        return {
            "INFERENCE_MODEL": b.model or "",
            "INFERENCE_EMBEDDING_MODEL": b.embedding_model or "",
            "INFERENCE_RERANK_MODEL": b.rerank_model or "",
            "INFERENCE_DTYPE": b.dtype,
            "INFERENCE_KV_CACHE_DTYPE": b.kv_cache_dtype,
            "INFERENCE_DEVICE": b.device,
            "INFERENCE_QUANTIZE": b.quantize,
            "INFERENCE_ROWS": str(b.rows),
            "INFERENCE_MAX_SEQ_LEN": str(b.max_seq_len or 0),
            "INFERENCE_KV_CACHE_MEMORY": str(b.kv_cache_memory or ""),
            "INFERENCE_MAX_PREFILL_TOKENS": str(b.max_prefill_tokens or 0),
            "INFERENCE_PREFIX_REUSE": "1" if b.prefix_reuse else "0",
            "INFERENCE_COMPILE": "1" if b.compile_decode else "0",
            "INFERENCE_TRUST_REMOTE_CODE": "1" if b.trust_remote_code else "0",
            "INFERENCE_CUDA_GRAPHS": "1" if b.cuda_graphs else "0",
            "INFERENCE_TORCH_THREADS": str(b.torch_threads or 0),
            "INFERENCE_SPECULATIVE_TOKENS": "" if b.speculative_tokens is None else str(b.speculative_tokens),
            "INFERENCE_DRAFT_MODEL": b.draft_model or "",
            "INFERENCE_PROMPT_LOOKUP_MIN": str(b.prompt_lookup_min),
            "INFERENCE_PROMPT_LOOKUP_MAX": str(b.prompt_lookup_max),
            "INFERENCE_LORA_MODULES": json.dumps([list(module) for module in b.lora_modules]),
            "INFERENCE_ALLOW_RUNTIME_LORA": "1" if b.runtime_lora else "0",
            "INFERENCE_MAX_LORAS": str(b.max_loras or 0),
            "INFERENCE_MAX_LORA_RANK": str(b.max_lora_rank or 0),
            "INFERENCE_GENERATION_CONFIG": b.generation_config,
            "INFERENCE_OVERRIDE_GENERATION_CONFIG": json.dumps(dict(b.override_generation_config)),
            "INFERENCE_MOCK": "1" if b.mock else "0",
            "INFERENCE_MOCK_TOKENS_PER_SECOND": repr(b.mock_tokens_per_second),
            "INFERENCE_MAX_QUEUE": str(self.max_queue),
            "INFERENCE_MAX_BODY_BYTES": str(self.max_body_bytes),
            "INFERENCE_EMBEDDING_POOLING": self.embedding_pooling,
            "INFERENCE_SERVED_MODEL_NAME": " ".join(self.served_model_names),
            "INFERENCE_CHAT_TEMPLATE": self.chat_template or "",
            "INFERENCE_REASONING_PARSER": self.reasoning_parser,
            "INFERENCE_TOOL_CALL_PARSER": self.tool_call_parser,
            "INFERENCE_HOST": self.host,
            "INFERENCE_PORT": str(self.port),
            "INFERENCE_RESTART_DELAY": repr(self.restart_delay),
            "INFERENCE_STEP_TIMEOUT": repr(self.step_timeout),
            **({"INFERENCE_MOCK_STALL_TEXT": b.mock_stall_text} if b.mock_stall_text else {}),
        }

    @property
    def threads(self) -> int:
        """gunicorn threads: one per request that may be in flight, plus a few so that /health,
        /metrics and the 503s past the queue are answered at once even when every slot is taken."""
        return self.backend.rows + self.max_queue + 8


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


# Sizes as people write them: KiB, MiB... are powers of 1024, KB, MB... of 1000; no unit is bytes.
SIZE_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**power
    for power, prefix in enumerate("kmgt", start=1)
    for suffix, base in (("ib", 1024), ("b", 1000))
}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A number of bytes from `2GiB`, `512MiB`, `1.5GB` or `3000000000`; ValueError, saying what is
    wanted, for anything else or for nothing at all."""
    match = SIZE.fullmatch(text)
    unit = SIZE_UNITS.get(match[2].lower()) if match else None
    if unit is None:
        raise ValueError(f"a size such as 2GiB, 512MiB, 1.5GB or a number of bytes, not {text!r}")
    size = int(Decimal(match[1]) * unit)
    if size < 1:
        raise ValueError(f"a size of at least one byte, not {text!r}")
    return size


def _size(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return parse_size(value)
    except ValueError as error:
        raise ValueError(f"{name} must be {error}") from None


def _lora_modules(env: Mapping[str, str], name: str) -> tuple[tuple[str, str], ...]:
    """--lora-modules as `to_env` writes them: a JSON list of [name, path] pairs."""
    try:
        pairs = json.loads(env.get(name) or "[]")
        if isinstance(pairs, list) and all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) for part in pair)
            for pair in pairs
        ):
            return tuple((adapter, path) for adapter, path in pairs)
    except ValueError:
        pass
    raise ValueError(f'{name} must be a JSON list of [name, path] pairs, as [["sql", "/adapters/sql"]]')


def _bool(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def parse_generation_override(text: str) -> tuple[tuple[str, float], ...]:
    """--override-generation-config's JSON object of sampling fields, each checked; ValueError saying
    what is wrong."""
    try:
        fields = json.loads(text)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise ValueError(f'a JSON object of sampling fields such as {{"temperature": 0.6}}, got {text!r}')
    return tuple((name, checked(name, value)) for name, value in fields.items())


def _generation_override(env: Mapping[str, str], name: str) -> tuple[tuple[str, float], ...]:
    """--override-generation-config as `to_env` writes it (its JSON), an error naming the variable."""
    try:
        return parse_generation_override(env.get(name) or "{}")
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
