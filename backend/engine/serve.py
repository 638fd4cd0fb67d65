"""The backend process's loop: inbox to engine, engine to outbox, one step at a time."""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection

from backend.engine.engine import Engine
from backend.engine.inbox import read_inbox
from backend.messages import (
    HEARTBEAT_SECONDS,
    AdaptersChanged,
    BackendConfig,
    BackendFailed,
    BackendReady,
    Cancel,
    EmbeddingModelReady,
    LoadAdapter,
    Shutdown,
    StepOutput,
    Submit,
    UnloadAdapter,
)
from backend.model.embeddings import EmbeddingModel
from backend.model.lora import AdapterError
from backend.model.resources import InsufficientResources
from backend.model.sampling_defaults import sampling_defaults
from backend.model.source import ModelNotFound
from backend.utils.thread_binding import hold_engine_thread

log = logging.getLogger(__name__)


def start_engine(config: BackendConfig) -> tuple[Engine, BackendReady]:
    engine = Engine.load(config)
    ready = BackendReady(
        model_name=engine.name,
        rows=config.rows,
        max_seq_len=engine.max_seq_len,
        tokenizer_path=engine.tokenizer_path,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        vocab_size=engine.vocab_size,
        embedding_model=separate_model_ready(engine.embedding_model),
        rerank_model=separate_model_ready(engine.rerank_model),
        adapters=engine.adapters.names if engine.adapters is not None else (),
        sampling_defaults=sampling_defaults(
            getattr(engine.model, "generation_config", None),
            config.generation_config,
            dict(config.override_generation_config),
        ),
    )
    return engine, ready


def change_adapters(engine: Engine, change: LoadAdapter | UnloadAdapter) -> AdaptersChanged:
    """Load or unload a LoRA adapter between two steps; the adapters served after, or why not."""
    try:
        if isinstance(change, LoadAdapter):
            engine.load_adapter(change.name, change.path, change.replace)
        else:
            engine.unload_adapter(change.name)
    except AdapterError as error:
        unknown = isinstance(change, UnloadAdapter) and change.name not in engine.adapter_names
        return AdaptersChanged(change.request_id, engine.adapter_names, str(error), not_found=unknown)
    return AdaptersChanged(change.request_id, engine.adapter_names)


def separate_model_ready(model: EmbeddingModel | None) -> EmbeddingModelReady | None:
    """What the frontend needs of a model beside the served one: its name, tokenizer and bounds."""
    if model is None:
        return None
    return EmbeddingModelReady(model.name, model.tokenizer_path, model.max_tokens, model.vocab_size)


def serve(config: BackendConfig, inbox: multiprocessing.Queue, outbox: Connection) -> None:
    try:
        engine, ready = start_engine(config)
    except (InsufficientResources, ModelNotFound, OSError, ValueError) as error:
        log.error("backend cannot start: %s", error)
        outbox.send(BackendFailed(str(error)))
        sys.exit(1)
    hold_engine_thread()  # on its core, as the pass's other threads are on theirs (a CPU's, if bound)
    log.info(
        "ready: %s, %d rows of %d tokens, %s on %s, KV cache in %s",
        ready.model_name,
        ready.rows,
        ready.max_seq_len,
        ready.dtype,
        ready.device,
        str(engine.runner.cache_dtype).removeprefix("torch."),
    )
    outbox.send(ready)
    # Made now, while requests are few: made at the first grammar, it stalled every row (Grammars.
    # make_tokenizer). Not before `ready`, which the 0.35 s it holds the GIL would hold up.
    engine.grammar_builds.make_tokenizer()
    last_sent = time.monotonic()
    while True:
        # Idle: sleep on the inbox (waking for the heartbeat). Busy: take what is there and step.
        for message in read_inbox(inbox, timeout=0 if engine.has_work else HEARTBEAT_SECONDS):
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Submit):
                engine.submit(message)
            elif isinstance(message, Cancel):
                engine.cancel(message.request_id)
            elif isinstance(message, LoadAdapter | UnloadAdapter):
                outbox.send(change_adapters(engine, message))
        try:
            pieces = engine.step()
        except Exception as error:  # a bad step must not take every other request down with it
            log.exception("decode step failed")
            pieces = engine.fail_all(f"generation failed: {error}")
        if pieces or engine.admitted or time.monotonic() - last_sent >= HEARTBEAT_SECONDS:
            outbox.send(StepOutput(pieces, engine.admitted))
            last_sent = time.monotonic()
