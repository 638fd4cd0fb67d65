"""LoRA adapters served beside the base model (backend/model/lora.py): rows of different adapters, and of
none, decode in one step, each as PEFT's model with its adapter alone would."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.messages import BackendConfig, SamplingParams, Submit
from backend.model.loader import cpu_multiplies_bf16
from backend.model.lora import AdapterError, LoraLinear, load_adapters
from tests.backend.lora_files import default_model_shapes, write_lora_adapter
from tests.backend.models import (
    TINY_VOCAB,
    MarkerTokenizer,
    drive,
    logprobs_of,
    reference_greedy,
    text_of,
    tiny_model,
    write_tiny_causal_lm,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def engine_with_adapters(base: torch.nn.Module, adapters: dict[str, object], **options) -> Engine:
    """An engine on a copy of `base` with these (name: directory) adapters loaded."""
    model = copy.deepcopy(base)
    loaded = load_adapters(model, [(name, str(path)) for name, path in adapters.items()])
    return Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128, adapters=loaded, **options)


# Llama's layers through the decoder runner, Qwen3's with its head norms, Falcon's (fused query, key and
# value) through transformers' own modules.
SOME_LAYERS = {"llama": ["q_proj", "v_proj", "down_proj"], "qwen3": ["k_proj", "o_proj", "up_proj"]}


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "falcon"])
def test_rows_of_two_adapters_and_of_none_decode_together_as_pefts_model_alone(tmp_path, architecture):
    base = tiny_model(architecture)
    references = {
        "": base,
        # One adapter of some layers, q, k and v each with its own, and one of every linear layer, rsLoRA
        "some": write_lora_adapter(tmp_path / "some", base, SOME_LAYERS.get(architecture, "all-linear")),
        "every": write_lora_adapter(tmp_path / "every", base, rank=8, seed=2, use_rslora=True),
    }
    engine = engine_with_adapters(base, {"some": tmp_path / "some", "every": tmp_path / "every"})
    rng = random.Random(architecture)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 40))] for _ in range(9)]
    names = ["", "some", "every"] * 3
    arrivals = [
        (i // 2, Submit(f"r{i}", tuple(prompt), GREEDY, adapter=name))
        for i, (prompt, name) in enumerate(zip(prompts, names, strict=True))
    ]
    pieces = drive(engine, arrivals)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        expected = reference_greedy(references[name], prompt, GREEDY.max_tokens, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == expected, f"r{i} ({name or 'base'})"
    # The adapters change the answers (else the test would show nothing)
    first = [reference_greedy(references[name], prompts[0], 12, engine.eos_ids) for name in names[:3]]
    assert first[0] != first[1] and first[0] != first[2]


def test_a_prefix_is_reused_by_its_own_adapters_rows_only(tmp_path):
    base = tiny_model("llama")
    reference = write_lora_adapter(tmp_path / "a", base, seed=3)
    engine = engine_with_adapters(base, {"a": tmp_path / "a"})
    prompt = tuple(range(10, 50))
    cached, answers = [], []
    for i, adapter in enumerate(["", "", "a", "a"]):  # one after the other: each finds the last's row
        pieces = drive(engine, [(0, Submit(f"r{i}", prompt, GREEDY, adapter=adapter))])[f"r{i}"]
        cached.append(pieces[-1].cached_tokens)
        answers.append(MarkerTokenizer.ids(text_of(pieces)))
    # The base model's keys and values are not the adapter's: the first adapter row prefills it all.
    assert cached[1] > 0 and cached[2] == 0 and cached[3] > 0
    assert answers[0] == answers[1] == reference_greedy(base, prompt, GREEDY.max_tokens, engine.eos_ids)
    assert answers[2] == answers[3] == reference_greedy(reference, prompt, GREEDY.max_tokens, engine.eos_ids)


def test_requests_for_an_adapter_not_loaded_or_to_embed_are_refused(tmp_path):
    base = tiny_model("llama")
    write_lora_adapter(tmp_path / "a", base)
    engine = engine_with_adapters(base, {"a": tmp_path / "a"})
    pieces = drive(
        engine,
        [
            (0, Submit("other", (5, 6), GREEDY, adapter="b")),
            (0, Submit("embed", (5, 6), SamplingParams(embedding="mean"), adapter="a")),
        ],
    )
    assert pieces["other"][-1].error == "no LoRA adapter 'b' is loaded"
    assert "does not embed" in pieces["embed"][-1].error


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "whole modules saved beside the adapter"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "a IA3 adapter; only LoRA adapters are served"),
    ],
)
def test_an_adapter_of_what_is_not_served_is_refused_with_the_reason(tmp_path, change, reason):
    base = tiny_model("llama")
    write_lora_adapter(tmp_path / "a", base)
    config_path = tmp_path / "a" / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | change))
    with pytest.raises(AdapterError, match=f"LoRA adapter 'a' .*{reason}"):
        load_adapters(copy.deepcopy(base), [("a", str(tmp_path / "a"))])


def test_adapters_of_the_head_or_of_another_model_or_no_adapter_at_all_are_refused(tmp_path):
    base = tiny_model("llama")
    write_lora_adapter(tmp_path / "head", base, ["lm_head"])
    write_lora_adapter(tmp_path / "wider", tiny_model("llama", head_dim=32), ["q_proj"])
    (tmp_path / "empty").mkdir()
    refusals = {
        "head": "lm_head: LoRA of the embeddings or the head is not served",
        "wider": "A is .* where the model's layer takes .*: an adapter of another model",
        "empty": "no adapter_config.json there",
    }
    for name, reason in refusals.items():
        model = copy.deepcopy(base)
        with pytest.raises(AdapterError, match=reason):
            load_adapters(model, [(name, str(tmp_path / name))])
    write_lora_adapter(tmp_path / "q", base, ["q_proj"])
    with pytest.raises(AdapterError, match="names the adapter 'q' twice"):
        load_adapters(copy.deepcopy(base), [("q", str(tmp_path / "q")), ("q", str(tmp_path / "q"))])


@pytest.fixture(scope="module")
def default_model_adapter(tmp_path_factory):
    """An adapter of the default model's shapes that changes every linear layer."""
    directory = tmp_path_factory.mktemp("adapters")
    shapes = default_model_shapes()  # PEFT adapts nn.Linear layers, not the quantized ones
    write_lora_adapter(directory / "story", shapes, rank=16, scale=0.05, seed=4)
    return (("story", str(directory / "story")),)


def test_the_default_models_quantized_rows_of_an_adapter_decode_beside_others_as_alone(default_model_adapter):
    """In the default mode (the GGUF file's blocks): a step of the base model's rows alone keeps the
    native decode; an adapter's rows decode beside them (a step of the layers in Python, the adapter's
    products added), each as it does alone, but for near ties. (Only the exact mode promises the same
    text in any step: here a float32 product of one row rounds otherwise than one of several, MKL's
    gemv against its gemm, and bfloat16 logits near 20 are 0.125 apart, so two tokens tie exactly.)"""
    # A budget of prompt tokens that no step time changes: sized by the times (the default), a loaded
    # machine chunked the six prompts otherwise, and rounded otherwise (a gap of 0.375 on CI)
    config = BackendConfig(lora_modules=default_model_adapter, rows=8, max_seq_len=512, max_prefill_tokens=64)
    engine = Engine.load(config)
    # Steps without an adapter's row run it, where the CPU multiplies bfloat16 (elsewhere the default mode
    # is float32, which decode_layers.cpp does not run)
    assert (engine.runner.decoder.native is not None) == cpu_multiplies_bf16()
    assert isinstance(engine.model.model.layers[0].self_attn.q_proj, LoraLinear)
    chat = [{"role": "user", "content": "Write a short story about a lighthouse."}]
    text = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tuple(engine.tokenizer(text, add_special_tokens=False).input_ids)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    alone = {}
    for adapter in ("", "story"):
        pieces = drive(engine, [(0, Submit("alone", prompt, params, adapter=adapter))])
        alone[adapter] = logprobs_of(pieces["alone"])
    assert [e.token_id for e in alone["story"]] != [e.token_id for e in alone[""]]
    together = [(0, Submit(f"{a}-{i}", prompt, params, adapter=a)) for i in range(3) for a in ("", "story")]
    pieces = drive(engine, together)
    rows = [logprobs_of(pieces[f"story-{i}"]) for i in range(3)]
    # One step's rows of the same input: the same tokens, but for near ties (a float32 product may sum
    # some rows in another order: on a 2-core AVX2 EPYC, MKL's gives 6 equal rows' last 2 otherwise)
    for run in (*rows[1:], alone["story"]):
        assert_same_tokens_but_for_near_ties(run, rows[0])


def assert_same_tokens_but_for_near_ties(run: list, other: list) -> None:
    """Two runs' greedy tokens are the same up to their first difference, which is a near tie in both (logits
    two bfloat16 steps apart at most): the base model's own first token, where the adapter of the test above
    tips a tie, is 0.75 behind in the adapter's logits."""
    tokens = [(a.token_id, b.token_id) for a, b in zip(run, other, strict=True)]
    first = next((k for k, (a, b) in enumerate(tokens) if a != b), None)
    if first is not None:
        ahead = [dict(entries[first].top) for entries in (run, other)]
        gaps = [abs(top.get(tokens[first][0], -99) - top.get(tokens[first][1], 99)) for top in ahead]
        assert max(gaps) <= 0.3, (first, ahead)


def runtime_engine(base: torch.nn.Module) -> Engine:
    """An engine on a copy of `base` that loads adapters while it serves (--allow-runtime-lora)."""
    model = copy.deepcopy(base)
    adapters = load_adapters(model, [], runtime=True)
    return Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128, adapters=adapters)


def test_adapters_loaded_and_unloaded_while_serving_answer_as_pefts_model_and_leave_nothing(tmp_path):
    base = tiny_model("llama")
    first = write_lora_adapter(tmp_path / "first", base, seed=5)
    second = write_lora_adapter(tmp_path / "second", base, ["q_proj", "down_proj"], rank=8, seed=6)
    engine = runtime_engine(base)
    prompt = tuple(range(10, 40))
    expected = {
        model: reference_greedy(model, prompt, GREEDY.max_tokens, engine.eos_ids)
        for model in (base, first, second)
    }

    def answer(pieces: list) -> list[int]:
        return MarkerTokenizer.ids(text_of(pieces))

    engine.load_adapter("a", str(tmp_path / "first"))
    engine.submit(Submit("a-running", prompt, GREEDY, adapter="a"))
    engine.submit(Submit("base", prompt, GREEDY))
    pieces: dict[str, list] = {}
    for _ in range(3):  # both rows prefilled and decoding
        for piece in engine.step():
            pieces.setdefault(piece.request_id, []).append(piece)
    assert all(row is not None for row in engine.rows[:2])
    engine.submit(Submit("a-waiting", prompt, GREEDY, adapter="a"))
    engine.unload_adapter("a")  # the waiting request ends; the running row finishes with the weights
    assert engine.adapter_names == ()
    for name, more in drive(engine, []).items():
        pieces.setdefault(name, []).extend(more)
    assert answer(pieces["a-running"]) == expected[first]
    assert answer(pieces["base"]) == expected[base]
    assert pieces["a-waiting"][-1].error == "the LoRA adapter 'a' was unloaded"
    # The last row of the unloaded adapter gone, its weights went with it.
    wrapped = [module for module in engine.model.modules() if isinstance(module, LoraLinear)]
    assert len(wrapped) == 7 * len(engine.model.model.layers)  # every linear layer but the head
    assert all(not layer.adapters for layer in wrapped) and not engine.adapters.retired

    # The same name again, another adapter: its rows reuse none of the first one's cached prefix.
    engine.load_adapter("a", str(tmp_path / "second"))
    again = drive(engine, [(0, Submit("a-again", prompt, GREEDY, adapter="a"))])["a-again"]
    assert answer(again) == expected[second] and again[-1].cached_tokens == 0
    assert expected[second] != expected[first] != expected[base]


def test_adapters_coming_and_going_in_any_order_stack_as_a_whole_restack_and_answer_as_peft(tmp_path):
    """A load adds its adapter's columns after the others', an unload takes them out (not every layer's
    matrices made again): with one of three unloaded from the middle and a fourth loaded, each layer's
    stack is what stacking them all afresh gives, and rows of each adapter decode as PEFT's model."""
    base = tiny_model("llama")
    references = {
        "": base,
        "a": write_lora_adapter(tmp_path / "a", base, seed=1),
        "b": write_lora_adapter(tmp_path / "b", base, ["k_proj", "up_proj"], rank=8, seed=2),
        "c": write_lora_adapter(tmp_path / "c", base, ["q_proj", "down_proj"], rank=2, seed=3),
        "d": write_lora_adapter(tmp_path / "d", base, ["v_proj", "o_proj", "gate_proj"], rank=6, seed=4),
    }
    engine = runtime_engine(base)
    for name in "abc":
        engine.load_adapter(name, str(tmp_path / name))
    engine.unload_adapter("b")  # no row of it: its columns go now
    engine.load_adapter("d", str(tmp_path / "d"))
    assert engine.adapter_names == ("a", "c", "d")
    prompt = tuple(range(10, 40))
    names = ["", "a", "c", "d"]
    pieces = drive(engine, [(0, Submit(f"r-{name}", prompt, GREEDY, adapter=name)) for name in names])
    answers = {name: MarkerTokenizer.ids(text_of(pieces[f"r-{name}"])) for name in names}
    for name in names:
        assert answers[name] == reference_greedy(references[name], prompt, GREEDY.max_tokens, engine.eos_ids)
    assert len({tuple(answer) for answer in answers.values()}) == 4  # each adapter changes the answer
    for changes in engine.adapters.batch.changes:
        stacked = (changes.down, changes.up, list(changes.column_slots))
        changes.restack()
        if changes.down is None:
            assert stacked[0] is None and stacked[1] is None
            continue
        assert torch.equal(stacked[0], changes.down) and torch.equal(stacked[1], changes.up)
        assert stacked[2] == changes.column_slots and 2 not in stacked[2]  # b's slot


def test_an_adapter_that_cannot_load_while_serving_changes_nothing(tmp_path):
    base = tiny_model("llama")
    write_lora_adapter(tmp_path / "wider", tiny_model("llama", head_dim=32), ["q_proj", "o_proj"])
    write_lora_adapter(tmp_path / "good", base, seed=7)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    engine = runtime_engine(base)
    engine.load_adapter("good", str(tmp_path / "good"))
    refusals = {
        "wider": "an adapter of another model",
        "broken": "adapter_config.json cannot be read",
        "missing": "no adapter_config.json there",
        "good": "a LoRA adapter named 'good' is already loaded",
    }
    for name, reason in refusals.items():
        with pytest.raises(AdapterError, match=reason):
            engine.load_adapter(name, str(tmp_path / name))
    with pytest.raises(AdapterError, match="no LoRA adapter 'other' is loaded"):
        engine.unload_adapter("other")
    assert engine.adapter_names == ("good",)
    slots = {
        slot
        for module in engine.model.modules()
        if isinstance(module, LoraLinear)
        for slot in module.adapters
    }
    assert slots == {engine.adapters.slots["good"]}  # no layer kept a refused adapter's weights
    prompt = tuple(range(5, 25))
    pieces = drive(engine, [(0, Submit("base", prompt, GREEDY))])["base"]
    assert MarkerTokenizer.ids(text_of(pieces)) == reference_greedy(base, prompt, 12, engine.eos_ids)


def test_only_a_server_started_for_it_loads_adapters_while_serving(tmp_path):
    base = tiny_model("llama")
    write_lora_adapter(tmp_path / "a", base)
    engine = engine_with_adapters(base, {"a": tmp_path / "a"})
    with pytest.raises(AdapterError, match="only with --allow-runtime-lora"):
        engine.load_adapter("b", str(tmp_path / "a"))
    with pytest.raises(AdapterError, match="only with --allow-runtime-lora"):
        engine.unload_adapter("a")


@pytest.mark.parametrize("architecture", ["qwen3_moe", "deepseek_v2", "falcon", "gemma3_text", "gpt_neox"])
def test_every_linear_layer_wrapped_for_adapters_to_come_leaves_the_models_rows_as_they_were(architecture):
    """With --allow-runtime-lora every linear layer is wrapped at start, mixtures of experts' routers and
    latent attention's projections included: the model's own rows decode as transformers' model does."""
    base = tiny_model(architecture)
    engine = runtime_engine(base)
    assert any(isinstance(module, LoraLinear) for module in engine.model.modules())
    rng = random.Random(architecture)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    pieces = drive(engine, [(i, Submit(f"r{i}", tuple(p), GREEDY)) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(base, prompt, GREEDY.max_tokens, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == expected, f"r{i}"


def test_a_restarted_backend_loads_again_what_was_loaded_while_running_and_skips_what_is_gone(
    tmp_path, caplog
):
    """The frontend gives a backend restarted after a crash the adapters loaded while running: one whose
    directory went meanwhile is left out with an error in the log, the server serves on."""
    base = tiny_model("llama")
    write_tiny_causal_lm(tmp_path / "model", "llama", base)
    reference = write_lora_adapter(tmp_path / "a", base, seed=8)
    loaded = (("gone", str(tmp_path / "gone")), ("a", str(tmp_path / "a")))
    config = BackendConfig(
        model=str(tmp_path / "model"), rows=2, max_seq_len=64, dtype="float32", quantize="none",
        runtime_lora=True, lora_modules_loaded=loaded, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    engine = Engine.load(config)
    assert engine.adapter_names == ("a",)
    assert "LoRA adapter 'gone'" in caplog.text and "not loaded again" in caplog.text
    prompt = tuple(range(3, 20))
    pieces = drive(engine, [(0, Submit("a", prompt, GREEDY, adapter="a"))])["a"]
    assert MarkerTokenizer.ids(text_of(pieces)) == reference_greedy(reference, prompt, 12, engine.eos_ids)


def test_max_loras_and_max_lora_rank_refuse_adapters_past_them_at_start_and_while_running(tmp_path):
    base = tiny_model("llama")
    write_lora_adapter(tmp_path / "four", base, rank=4, seed=1)
    write_lora_adapter(tmp_path / "other", base, ["q_proj"], rank=4, seed=2)
    write_lora_adapter(tmp_path / "eight", base, rank=8, seed=3)
    model = copy.deepcopy(base)
    with pytest.raises(AdapterError, match="rank 8, over --max-lora-rank 4"):
        load_adapters(model, [("eight", str(tmp_path / "eight"))], highest_rank=4)
    specs = [("four", str(tmp_path / "four")), ("other", str(tmp_path / "other"))]
    with pytest.raises(AdapterError, match="1 LoRA adapters are loaded, the most --max-loras allows"):
        load_adapters(copy.deepcopy(base), specs, most=1)
    model = copy.deepcopy(base)
    adapters = load_adapters(model, specs[:1], runtime=True, most=1, highest_rank=4)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=64, adapters=adapters)
    with pytest.raises(AdapterError, match="the most --max-loras allows"):
        engine.load_adapter("other", str(tmp_path / "other"))
    engine.unload_adapter("four")
    with pytest.raises(AdapterError, match="over --max-lora-rank 4"):
        engine.load_adapter("eight", str(tmp_path / "eight"))
    engine.load_adapter("other", str(tmp_path / "other"))  # a place again, once one is unloaded
    assert engine.adapter_names == ("other",)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_rows_of_an_adapter_loaded_while_serving_and_of_none_decode_as_pefts_model_on_cuda(tmp_path):
    """The LoRA products on a GPU (scripts/gpu_check.sh runs it where one is lent): float32 rows of an
    adapter loaded while serving and of the model, in one step, each as PEFT's model alone there."""
    base = tiny_model("llama")
    reference = write_lora_adapter(tmp_path / "a", base, seed=9).cuda()
    engine = runtime_engine(base.cuda())
    engine.load_adapter("a", str(tmp_path / "a"))
    rng = random.Random(9)
    prompts = [tuple(rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 30))) for _ in range(4)]
    names = ["a", "", "a", ""]
    arrivals = [
        (i, Submit(f"r{i}", prompt, GREEDY, adapter=name))
        for i, (prompt, name) in enumerate(zip(prompts, names, strict=True))
    ]
    pieces = drive(engine, arrivals)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        expected = reference_greedy(reference if name else base, prompt, GREEDY.max_tokens, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == expected, f"r{i} ({name or 'base'})"


def test_an_adapter_reloaded_in_place_serves_its_waiting_requests_while_its_rows_finish_with_the_old(
    tmp_path,
):
    """vLLM's load_inplace: a new version under the same name, without a moment the name is not served."""
    base = tiny_model("llama")
    first = write_lora_adapter(tmp_path / "first", base, seed=10)
    second = write_lora_adapter(tmp_path / "second", base, seed=11)
    engine = runtime_engine(base)
    prompt = tuple(range(30, 60))
    engine.load_adapter("a", str(tmp_path / "first"))
    engine.submit(Submit("running", prompt, GREEDY, adapter="a"))
    pieces: dict[str, list] = {}
    for _ in range(3):
        for piece in engine.step():
            pieces.setdefault(piece.request_id, []).append(piece)
    engine.submit(Submit("waiting", prompt, GREEDY, adapter="a"))
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_adapter("a", str(tmp_path / "second"))
    engine.load_adapter("a", str(tmp_path / "second"), replace=True)
    assert engine.adapter_names == ("a",)
    for name, more in drive(engine, []).items():
        pieces.setdefault(name, []).extend(more)
    answers = {name: MarkerTokenizer.ids(text_of(pieces[name])) for name in ("running", "waiting")}
    assert answers["running"] == reference_greedy(first, prompt, GREEDY.max_tokens, engine.eos_ids)
    assert answers["waiting"] == reference_greedy(second, prompt, GREEDY.max_tokens, engine.eos_ids)
    assert pieces["waiting"][-1].cached_tokens == 0  # the first version's prefix is not the second's
    assert answers["running"] != answers["waiting"]
    slots = {
        slot
        for module in engine.model.modules()
        if isinstance(module, LoraLinear)
        for slot in module.adapters
    }
    assert slots == {engine.adapters.slots["a"]} and not engine.adapters.retired


def test_an_adapter_named_by_its_hub_id_is_downloaded_at_start_and_refused_while_serving(
    tmp_path, monkeypatch
):
    """As vLLM's --lora-modules take them: `org/name` where no such directory is. Here the hub's cache
    holds the repository (written as huggingface_hub lays it out) and the hub is offline."""
    from huggingface_hub import constants

    base = tiny_model("llama")
    reference = write_lora_adapter(tmp_path / "saved", base, seed=12)
    repository = tmp_path / "hub" / "models--team--story-lora"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repository / "snapshots").mkdir(parents=True)
    (tmp_path / "saved").rename(repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # where no directory team/story-lora is

    model = copy.deepcopy(base)
    adapters = load_adapters(model, [("story", "team/story-lora")], runtime=True)
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=64, adapters=adapters)
    prompt = tuple(range(7, 30))
    pieces = drive(engine, [(0, Submit("story", prompt, GREEDY, adapter="story"))])["story"]
    assert MarkerTokenizer.ids(text_of(pieces)) == reference_greedy(reference, prompt, 12, engine.eos_ids)
    with pytest.raises(AdapterError, match="download it first: hf download team/story-lora --local-dir DIR"):
        engine.load_adapter("again", "team/story-lora")
    with pytest.raises(AdapterError, match="no directory there, and no hub repository to download"):
        load_adapters(copy.deepcopy(base), [("none", "team/no-such-lora")])
