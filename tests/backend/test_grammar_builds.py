"""Grammars compiled beside the engine's thread (backend/engine/grammar_builds.py): rows step on while a
request's grammar compiles, and that request waits for its matcher, is refused by it, or is cancelled
or unloaded meanwhile. Builds are held back with an event where the point is a build that takes long."""

import copy
import json
import multiprocessing
import queue
import threading

import llguidance
import pytest

from backend.engine import grammar_builds
from backend.engine.engine import Engine
from backend.engine.serve import serve
from backend.messages import BackendConfig, BackendReady, SamplingParams, Shutdown, Submit
from backend.model.lora import load_adapters
from tests.backend.lora_files import write_lora_adapter
from tests.backend.models import byte_tokenizer, drive, text_of, tiny_model

ANSWER = llguidance.LLMatcher.grammar_from_regex("(yes|no)")
FREE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def engine() -> Engine:
    return Engine(tiny_model("qwen2"), byte_tokenizer(("<|endoftext|>",)), rows=4, max_seq_len=64)


class HeldBuilds:
    """The engine's grammar builds, each held until `release()` (a big schema's, as it were)."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch):
        self.released = threading.Event()
        self.started = threading.Event()
        compile_now = engine.grammars.matcher

        def held(grammar: str | None):
            self.started.set()
            self.released.wait(timeout=60)
            return compile_now(grammar)

        monkeypatch.setattr(engine.grammars, "matcher", held)

    def release(self) -> None:
        self.released.set()


def pieces_of(engine: Engine, steps: int) -> dict[str, list]:
    pieces: dict[str, list] = {}
    for _ in range(steps):
        for piece in engine.step():
            pieces.setdefault(piece.request_id, []).append(piece)
    return pieces


def test_rows_step_on_while_a_grammar_compiles_and_its_request_starts_once_it_has(engine, monkeypatch):
    alone = drive(engine, [(0, Submit("free", (5, 6), FREE))])["free"]
    builds = HeldBuilds(engine, monkeypatch)
    engine.submit(Submit("free", (5, 6), FREE))
    first = pieces_of(engine, 2)
    engine.submit(Submit("constrained", (7, 8), SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)))
    assert builds.started.wait(timeout=60)
    row = engine._row_of("free")
    before = len(row.generated)
    meanwhile = pieces_of(engine, 4)
    assert "constrained" in engine.grammar_builds and "constrained" not in engine.waiting
    assert "constrained" not in meanwhile and len(row.generated) == before + 4  # a token a step
    builds.release()
    rest = drive(engine, [])
    assert text_of(first["free"] + meanwhile["free"] + rest["free"]) == text_of(alone)
    assert text_of(rest["constrained"]) in ("yes", "no")
    assert rest["constrained"][-1].finish_reason == "stop"


def test_a_grammar_refused_when_its_build_ends_fails_that_request_alone(engine, monkeypatch):
    builds = HeldBuilds(engine, monkeypatch)
    engine.submit(Submit("free", (5, 6), FREE))
    engine.submit(Submit("broken", (7, 8), SamplingParams(temperature=0, max_tokens=5, grammar="start: (((")))
    meanwhile = pieces_of(engine, 2)
    assert "broken" not in meanwhile
    builds.release()
    pieces = drive(engine, [])
    [refused] = pieces["broken"]
    assert refused.finish_reason == "error" and refused.invalid == "grammar"
    assert "invalid grammar" in refused.error
    assert pieces["free"][-1].finish_reason == "length" and pieces["free"][-1].completion_tokens == 12
    assert not engine.arrived  # the refused request's arrival went with it


def test_a_build_that_fails_past_llguidances_own_errors_fails_that_request_alone(engine, monkeypatch):
    # As a panic of llguidance's would (pyo3's PanicException, a BaseException); in the engine's thread
    # before, it ended the backend process and every row's work with it.
    def failing(grammar: str | None):
        raise RuntimeError("the compiler broke")

    monkeypatch.setattr(engine.grammars, "matcher", failing)
    broken = SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)
    pieces = drive(engine, [(0, Submit("free", (5, 6), FREE)), (0, Submit("broken", (7, 8), broken))])
    [refused] = pieces["broken"]
    assert refused.finish_reason == "error" and refused.invalid == "grammar"
    assert refused.error == "the grammar could not be compiled: the compiler broke"
    assert pieces["free"][-1].finish_reason == "length"


def test_a_request_cancelled_while_its_grammar_compiles_ends_at_once_and_never_takes_a_row(
    engine, monkeypatch
):
    builds = HeldBuilds(engine, monkeypatch)
    engine.submit(Submit("constrained", (7, 8), SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)))
    engine.cancel("constrained")
    [cancelled] = engine.step()
    assert cancelled.request_id == "constrained" and cancelled.finish_reason == "cancelled"
    builds.release()
    assert drive(engine, []) == {}
    assert not engine.has_work and not engine.matchers and not engine.arrived


def test_a_request_id_in_use_by_a_compiling_request_is_refused(engine, monkeypatch):
    builds = HeldBuilds(engine, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)
    engine.submit(Submit("same", (7, 8), params))
    engine.submit(Submit("same", (7, 8), FREE))
    [refused] = engine.step()
    assert refused.finish_reason == "error" and "already in use" in refused.error
    builds.release()
    [*_, last] = drive(engine, [])["same"]
    assert last.finish_reason == "stop"


def test_an_adapter_unloaded_or_replaced_while_a_grammar_compiles_counts_for_its_request(
    tmp_path, monkeypatch
):
    base = tiny_model("qwen2")
    for name, seed in (("first", 1), ("second", 2), ("third", 3)):
        write_lora_adapter(tmp_path / name, base, seed=seed)
    model = copy.deepcopy(base)
    tokenizer = byte_tokenizer(("<|endoftext|>",))
    engine = Engine(model, tokenizer, rows=4, max_seq_len=64, adapters=load_adapters(model, [], runtime=True))
    engine.load_adapter("a", str(tmp_path / "first"))
    engine.load_adapter("b", str(tmp_path / "second"))
    builds = HeldBuilds(engine, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)
    engine.submit(Submit("of-a", (7, 8), params, adapter="a"))
    engine.submit(Submit("of-b", (7, 8), params, adapter="b"))
    engine.unload_adapter("a")
    [refused] = engine.step()
    assert refused.request_id == "of-a" and refused.error == "the LoRA adapter 'a' was unloaded"
    scope = engine.grammar_builds.requests["of-b"].cache_scope
    engine.load_adapter("b", str(tmp_path / "third"), replace=True)
    assert engine.grammar_builds.requests["of-b"].cache_scope != scope  # the new weights' prefixes
    builds.release()
    pieces = drive(engine, [])
    assert list(pieces) == ["of-b"] and text_of(pieces["of-b"]) in ("yes", "no")


def test_an_engine_with_only_a_build_to_wait_for_sleeps_on_it_instead_of_spinning(engine, monkeypatch):
    builds = HeldBuilds(engine, monkeypatch)
    sleeps = []
    wait = engine.grammar_builds.wait
    monkeypatch.setattr(engine.grammar_builds, "wait", lambda: sleeps.append(1) or wait())
    engine.submit(Submit("constrained", (7, 8), SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)))
    assert engine.has_work and engine.step() == []
    assert sleeps == [1]
    engine.submit(Submit("free", (5, 6), FREE))
    engine.step()  # a row to step: no sleep
    assert sleeps == [1]
    builds.release()
    drive(engine, [])


def test_a_grammar_built_within_the_submits_wait_is_ready_for_the_next_step(engine, monkeypatch):
    # The engine waits a little for each build (SUBMIT_WAIT_SECONDS): a usual grammar, which compiles in
    # about a millisecond, is queued at once, and its request takes a row in the very next step, as when
    # grammars compiled in the engine's thread. (The wait is stretched here: the point is not the speed.)
    monkeypatch.setattr(grammar_builds, "SUBMIT_WAIT_SECONDS", 60.0)
    engine.submit(Submit("constrained", (7, 8), SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)))
    assert "constrained" in engine.waiting
    engine.step()
    assert engine.admitted == ["constrained"]


def test_a_big_schema_compiled_in_its_thread_constrains_its_row(engine, monkeypatch):
    """A big schema (a 20,000-value enum) built on the builds' thread past the submit, its matcher then
    used in the engine's: the answer is one of the values."""
    monkeypatch.setattr(grammar_builds, "SUBMIT_WAIT_SECONDS", 0.0)  # the build goes on past the submit
    values = [f"v{i}" for i in range(20_000)]
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"enum": values})
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, grammar=grammar)
    pieces = drive(engine, [(0, Submit("free", (5, 6), FREE)), (0, Submit("enum", (7, 8), params))])
    assert json.loads(text_of(pieces["enum"])) in values
    assert pieces["free"][-1].finish_reason == "length"


def test_a_backend_makes_the_grammars_tokenizer_as_soon_as_it_has_said_it_is_ready(engine, monkeypatch):
    """llguidance's tokenizer holds the GIL for 0.35 s of its making: made at the first grammar, it
    stalled every row, so the backend's loop makes it at start, once `ready` is sent (not to hold it up)."""
    receiving, sending = multiprocessing.Pipe(duplex=False)
    events, made = [], []
    start_making = engine.grammar_builds.make_tokenizer

    def make():
        events.append("making the tokenizer")
        made.append(start_making())
        return made[-1]

    class Outbox:
        def send(self, message) -> None:
            events.append(type(message).__name__)
            sending.send(message)

    monkeypatch.setattr(engine.grammar_builds, "make_tokenizer", make)
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, config: engine))
    inbox: queue.Queue = queue.Queue()
    backend = threading.Thread(target=serve, args=(BackendConfig(), inbox, Outbox()))
    backend.start()
    try:
        assert receiving.poll(60) and isinstance(receiving.recv(), BackendReady)
    finally:
        inbox.put(Shutdown())
        backend.join(timeout=60)
    assert not backend.is_alive()
    assert events[:2] == ["BackendReady", "making the tokenizer"]
    made[0].result(timeout=60)
    assert engine.grammars._tokenizer is not None


def test_a_tokenizer_grammars_cannot_use_is_tried_once_and_each_grammar_is_refused_with_why(
    monkeypatch, caplog
):
    tokenizer = byte_tokenizer(("<|endoftext|>",))
    tokenizer.add_tokens(["<added>"])  # 513 tokens for the model's 512 embeddings: llguidance refuses it
    engine = Engine(tiny_model("qwen2"), tokenizer, rows=2, max_seq_len=64)
    tries = []
    make = llguidance.hf.from_tokenizer
    monkeypatch.setattr(
        llguidance.hf, "from_tokenizer", lambda *args, **kw: tries.append(1) or make(*args, **kw)
    )
    engine.grammar_builds.make_tokenizer().result(timeout=60)  # as a backend does at start
    assert "cannot be used for grammars" in caplog.text
    constrained = SamplingParams(temperature=0, max_tokens=5, grammar=ANSWER)
    pieces = drive(engine, [(0, Submit("a", (5, 6), constrained)), (0, Submit("b", (5, 6), constrained))])
    for request_id in ("a", "b"):
        assert "tokenizer cannot be used for grammars" in pieces[request_id][-1].error
    assert len(tries) == 1
