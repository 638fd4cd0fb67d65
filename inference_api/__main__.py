"""`python -m inference_api [options]`: the API server alone, under gunicorn (SPEC §2).

The options become INFERENCE_* environment variables (see config.py) and the
process execs gunicorn with gunicorn.conf.py, so the server's pid is this
process's pid and signals reach gunicorn's master directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jinja2 import TemplateError

from backend.messages import BackendConfig
from backend.model.source import ModelNotFound, resolve_model
from inference_api.chat_template import compile_template
from inference_api.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_STEP_TIMEOUT,
    ServerConfig,
    parse_generation_override,
    parse_size,
)
from inference_api.reasoning import REASONING_PARSERS
from inference_api.tool_calls import TOOL_CALL_PARSERS
from inference_api.vllm_options import VllmOptionError, without_vllm_options

GUNICORN_CONF = Path(__file__).resolve().parent.parent / "gunicorn.conf.py"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be over 0, got {value}")
    return value


def memory_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"must be {error}") from None


def generation_config(text: str) -> str:
    """vLLM's --generation-config: auto, vllm, or a directory with a generation_config.json (absolute:
    gunicorn may run elsewhere)."""
    if text in ("auto", "vllm"):
        return text
    if not (Path(text) / "generation_config.json").is_file():
        expected = "auto, vllm or a directory with a generation_config.json"
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
    return str(Path(text).resolve())


def generation_override(text: str) -> tuple[tuple[str, float], ...]:
    """vLLM's --override-generation-config: a JSON object of sampling fields and their defaults."""
    try:
        return parse_generation_override(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def served_name(text: str) -> str:
    """A name requests may call the model by: in a URL path and in INFERENCE_SERVED_MODEL_NAME, which
    separates names by spaces."""
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"a model name is non-empty and has no spaces, got {text!r}")
    return text


def lora_module(text: str) -> tuple[str, str]:
    """vLLM's --lora-modules value: NAME=PATH, or its JSON form {"name": ..., "path": ...}; the path
    absolute where it exists (gunicorn may run elsewhere)."""
    if text.startswith("{"):
        try:
            value = json.loads(text)
            name, path = value["name"], value["path"]
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}') from None
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return served_name(name), os.path.abspath(path) if os.path.exists(path) else path


def chat_template_file(path: str) -> str:
    """A template file that reads and compiles, as its absolute path (gunicorn may run elsewhere)."""
    try:
        with open(path, encoding="utf-8") as file:
            compile_template(file.read())
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error.strerror}") from None
    except (TemplateError, UnicodeDecodeError) as error:
        raise argparse.ArgumentTypeError(f"{path} is not a Jinja template: {error}") from None
    return os.path.abspath(path)


def build_parser() -> argparse.ArgumentParser:
    """Every option of `python -m inference_api` (docs/configuration.md lists each)."""
    parser = argparse.ArgumentParser(prog="python -m inference_api", description=__doc__.split("\n")[0])
    parser.add_argument("--mock", action="store_true", help="the mock backend: no model, no torch")
    parser.add_argument(
        "--model", help="local directory, hub id or GGUF file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        type=served_name,
        default=[],
        metavar="NAME",
        help="the names requests may give the model (`model`, /predictions/NAME), the first the one "
        "responses and /ready report; /v1/models lists each (default: the model directory's name, "
        "the hub id, the GGUF file's stem, or mock)",
    )
    parser.add_argument(
        "--chat-template",
        type=chat_template_file,
        metavar="PATH",
        help="a Jinja chat template file for chat requests instead of the model's own (vLLM's option)",
    )
    parser.add_argument(
        "--generation-config",
        type=generation_config,
        default="auto",
        metavar="auto|vllm|DIR",
        help="the defaults of the sampling fields a request leaves out in the OpenAI, Responses and "
        "Anthropic APIs (vLLM's option): auto, those the model's generation_config.json recommends "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens); vllm, the "
        "APIs' own; or a directory's generation_config.json (default: auto)",
    )
    parser.add_argument(
        "--override-generation-config",
        type=generation_override,
        metavar="JSON",
        help="sampling defaults over --generation-config's, as a JSON object (vLLM's option): "
        """'{"temperature": 0.6, "top_p": 0.95}'""",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="chat answers' thoughts as reasoning_content: auto reads gpt-oss's harmony messages where "
        "the model writes them, and <think> blocks, Gemma 4's thought channel or Mistral's [THINK] blocks "
        "where the model has the tags as tokens and its template writes them; deepseek_r1, qwen3, glm45, "
        "olmo3 or deepseek_v3 (vLLM's names) always <think> blocks, gemma4 the thought channel, mistral "
        "[THINK] blocks, cohere_command4 Cohere's plans, openai_gptoss harmony; none never",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="the format chat answers' tool calls are read in and held to (vLLM's names); auto: the one "
        "the chat template teaches (Gemma 4's, FunctionGemma's, Mistral's, Granite 3's, DeepSeek's, LFM2's, "
        "Jamba's, Nemotron Nano 2's, Phi-4-mini's, Cohere's, the XML of Qwen3-Coder, GLM-4.5, Seed-OSS or "
        "MiniMax-M2, Llama 3's JSON, else Hermes); pythonic (never guessed) Llama 3.2's Python list of "
        "calls; a gpt-oss's are harmony messages whatever this says",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="taken so that vLLM's command lines start, with no effect: tool_choice auto needs nothing here",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=positive_int, default=DEFAULT_PORT)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="keys and values of the cache; auto: float32 on a CPU (its attention is fastest there), "
        "else the model's dtype",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--quantize",
        choices=["auto", "none", "int4", "int8", "fp8"],
        default="auto",
        help="quantized linear layers; auto: a GGUF file's or quantized checkpoint's own weights, else "
        "none; int4 and int8 weight-only; fp8 FP8 products on a GPU with FP8. "
        "--dtype float32 --quantize none is the exact mode",
    )
    parser.add_argument(
        "--rows", "--max-num-seqs", type=positive_int, default=32, help="requests decoded together"
    )
    parser.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait for a row",
    )
    parser.add_argument(
        "--max-seq-len",
        "--max-model-len",
        type=positive_int,
        help="tokens per row (prompt + answer); default: the smaller of 2048 and the model's context",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        metavar="SIZE",
        help="what the KV cache may take (2GiB, 512MiB, 1.5GB or bytes): without --max-seq-len, rows hold "
        "the most positions that fit, up to the model's context; with it, that length must fit (the "
        "start-up log gives the cache's size)",
    )
    parser.add_argument(
        "--compile",
        dest="compile_decode",
        action="store_true",
        help="compile decode steps of few rows with torch.compile: faster at a few streams, after a start-up "
        "that compiles them (a few minutes on a small CPU, less once compiled; docs/performance.md)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_false",
        help="on a GPU, run decode steps eagerly instead of as CUDA graphs captured at start-up",
    )
    parser.add_argument(
        "--no-prefix-reuse",
        "--no-enable-prefix-caching",
        dest="prefix_reuse",
        action="store_false",
        help="prefill every prompt whole, even where a row holds its first tokens already",
    )
    parser.add_argument(
        "--disable-log-requests",
        "--disable-log-stats",
        action="store_true",
        dest="quiet_log",
        help="taken so that vLLM's command lines start, with no effect: this server logs no line a request "
        "and no periodic figures (its figures are /metrics')",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        dest="enable_prefix_caching",
        help="taken so that vLLM's command lines start, with no effect: prefixes are reused by default",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=non_negative_int,
        metavar="N",
        help="speculative decoding by prompt lookup (vLLM's num_speculative_tokens of its ngram method): at "
        "most N draft tokens a row and step, 0 for none (default: 8 where decode steps run on the CPU's "
        "attention loop, 0 elsewhere); greedy and seeded output is the same either way (docs/backend.md)",
    )
    parser.add_argument(
        "--draft-model",
        metavar="PATH",
        help="speculative decoding with this small model's greedy guesses as the drafts, in place of prompt "
        "lookup: a model directory, GGUF file or hub id of the served model's tokenizer (a smaller model "
        "of its family), loaded in the default mode whatever --dtype and --quantize say (docs/backend.md)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (directories PEFT saved) served beside the model, each under its NAME: a "
        "request whose `model` names one is answered with it, in the same steps as the others' rows; "
        '/v1/models lists them (docs/backend.md, "LoRA adapters")',
    )
    parser.add_argument(
        "--max-loras",
        type=positive_int,
        metavar="N",
        help="the most LoRA adapters loaded at once: more at start stop the server, a load past it while "
        "running is a 400 (default: no limit)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=positive_int,
        metavar="N",
        help="the highest rank a LoRA adapter may have; one of a higher rank is refused (default: no limit)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="taken so that vLLM's command lines start, with no effect: --lora-modules and "
        "--allow-runtime-lora need nothing more here",
    )
    parser.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="LoRA adapters may be loaded and unloaded while the server runs, by POST /v1/load_lora_adapter "
        "and /v1/unload_lora_adapter (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING): the operator's "
        "endpoints, which the proxy does not forward",
    )
    parser.add_argument(
        "--prompt-lookup-min",
        type=positive_int,
        default=2,
        metavar="N",
        help="the shortest n-gram prompt lookup matches",
    )
    parser.add_argument(
        "--prompt-lookup-max",
        type=positive_int,
        default=4,
        metavar="N",
        help="the longest n-gram prompt lookup matches (tried first)",
    )
    parser.add_argument(
        "--max-prefill-tokens",
        "--max-num-batched-tokens",
        type=positive_int,
        help="prompt tokens a step prefills while rows decode, longer prompts a chunk a step (default: as "
        "many as keep a step within 1.8 times one without, measured as it runs, at most 512)",
    )
    parser.add_argument(
        "--torch-threads", type=positive_int, help="CPU threads for the model (default: every core)"
    )
    parser.add_argument(
        "--embedding-pooling",
        choices=["mean", "last"],
        default="mean",
        help="/v1/embeddings: the mean of the tokens' last hidden states, or the last token's",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's own configuration and tokenizer code (its auto_map), as transformers' "
        "trust_remote_code: code from the model's files, run in the backend process; its own modeling "
        "code is refused either way (a model of a type transformers has classes for, DeepSeek's say, is "
        "served by those, none of its own modeling or configuration code run)",
    )
    parser.add_argument(
        "--embedding-model",
        help="/v1/embeddings from this sentence-embedding model (a directory or hub id that "
        "transformers' AutoModel loads, a BERT-like encoder say) instead of the served model",
    )
    parser.add_argument(
        "--rerank-model",
        help="/v1/rerank from this cross-encoder (a directory or hub id that transformers' "
        "AutoModelForSequenceClassification loads with one label, a BGE or MS MARCO reranker say)",
    )
    parser.add_argument("--mock-tokens-per-second", type=positive_float, default=50.0)
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument(
        "--restart-delay", type=positive_float, default=1.0, help="seconds before restarting a dead backend"
    )
    parser.add_argument(
        "--step-timeout",
        type=positive_float,
        default=DEFAULT_STEP_TIMEOUT,
        help="seconds without a step (or the backend's heartbeat) after which the backend is restarted",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    try:
        argv = without_vllm_options(sys.argv[1:] if argv is None else argv)
    except VllmOptionError as error:
        parser.error(str(error))
    args = parser.parse_args(argv)
    model, embedding_model, rerank_model, draft_model = (
        os.path.abspath(path) if path and os.path.exists(path) else path  # gunicorn may run elsewhere
        for path in (args.model, args.embedding_model, args.rerank_model, args.draft_model)
    )
    backend = BackendConfig(
        model=model,
        embedding_model=embedding_model,
        rerank_model=rerank_model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        quantize=args.quantize,
        rows=args.rows,
        max_seq_len=args.max_seq_len,
        kv_cache_memory=args.kv_cache_memory,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_reuse=args.prefix_reuse,
        compile_decode=args.compile_decode,
        trust_remote_code=args.trust_remote_code,
        cuda_graphs=args.cuda_graphs,
        torch_threads=args.torch_threads,
        mock=args.mock,
        mock_tokens_per_second=args.mock_tokens_per_second,
        speculative_tokens=args.speculative_tokens,
        draft_model=draft_model,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        lora_modules=tuple(args.lora_modules),
        runtime_lora=args.allow_runtime_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config or (),
    )
    return ServerConfig(
        backend=backend,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        host=args.host,
        port=args.port,
        restart_delay=args.restart_delay,
        step_timeout=args.step_timeout,
        embedding_pooling=args.embedding_pooling,
        served_model_names=tuple(dict.fromkeys(args.served_model_name)),  # in order, once each
        chat_template=args.chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
    )


def check_models(config: ServerConfig) -> None:
    """A model option naming a local file or directory that is not there stops the command line as an
    option refused (status 2), before gunicorn starts: the backend would say so only after its 8 s of
    importing torch. (The mock loads no model; parse_args alone checks no path, so that a manifest's
    options parse where its volume is not mounted.)"""
    backend = config.backend
    if backend.mock:
        return
    options = {"--model": backend.model, "--draft-model": backend.draft_model}
    options |= {"--embedding-model": backend.embedding_model, "--rerank-model": backend.rerank_model}
    for option, value in options.items():
        if value is None and option != "--model":  # no --model: the default model, checked too
            continue
        try:
            resolve_model(value)
        except ModelNotFound as error:
            build_parser().error(f"argument {option}: {error}")


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    check_models(config)
    os.environ.update(config.to_env())
    command = [sys.executable, "-m", "gunicorn", "--config", str(GUNICORN_CONF)]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
