"""REAL MODEL: LoRA adapters (--lora-modules) as clients meet them, on the default model in the exact
mode (whose rows' text is the same in any step, SPEC §5): a request whose `model` names an adapter is
answered with it, beside the model's own requests in the same steps; /v1/models lists the adapters with
the model as their parent, as vLLM's does; TGI's `adapter_id` and the native API's model path name them
too; vLLM's endpoints load and unload them while the server runs."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from tests.server_fixture import RunningServer, running_server, start_server, stop_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of the default model's shapes, written by PEFT: one that changes nothing (its B
    matrices zeros), one that changes every linear layer."""
    from tests.backend.lora_files import default_model_shapes, write_lora_adapter  # torch: here only

    directory = tmp_path_factory.mktemp("adapters")
    shapes = default_model_shapes()
    write_lora_adapter(directory / "zero", shapes, rank=8, scale=0.0)
    write_lora_adapter(directory / "story", shapes, rank=16, scale=0.05, seed=4)
    return {"zero": directory / "zero", "story": directory / "story"}


@pytest.fixture(scope="module")
def hub_cache(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache, laid out as huggingface_hub writes one, holding the story adapter as team/story-lora."""
    cache = tmp_path_factory.mktemp("hub")
    repository = cache / "models--team--story-lora"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(adapters["story"], repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    return cache


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path], hub_cache: Path) -> Iterator[RunningServer]:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    exact = ["--rows", "4", "--max-seq-len", "1024", "--dtype", "float32", "--quantize", "none"]
    runtime = "--allow-runtime-lora"  # and adapters loaded while it runs
    with pytest.MonkeyPatch.context() as environment:  # the hub: this cache alone, no network
        environment.setenv("HF_HUB_CACHE", str(hub_cache))
        environment.setenv("HF_HUB_OFFLINE", "1")
        with running_server(*exact, "--lora-modules", *modules, runtime, ready_timeout=300) as running:
            yield running


def chat(client: openai.OpenAI, model: str, stream: bool = False) -> tuple[str, str]:
    """A greedy chat's text and the model its answer names."""
    ask = {"model": model, "messages": CHAT, "temperature": 0, "max_tokens": 24}
    if not stream:
        answer = client.chat.completions.create(**ask)
        return answer.choices[0].message.content, answer.model
    chunks = list(client.chat.completions.create(**ask, stream=True))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[0].model


def test_models_lists_each_adapter_with_the_model_as_its_parent(server):
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    listed = {entry["id"]: entry for entry in models}
    assert list(listed) == [MODEL, "zero", "story"]
    assert listed["story"]["parent"] == listed["zero"]["parent"] == MODEL
    assert "parent" not in listed[MODEL]
    assert server.openai_client().models.retrieve("story").id == "story"


def test_an_adapter_answers_the_requests_that_name_it_alone_and_beside_the_models_own(server):
    client = server.openai_client()
    for model in (MODEL, "zero", "story"):  # each finds the prompt cached after this (see below)
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=1)
    alone = {model: chat(client, model) for model in (MODEL, "zero", "story")}
    assert {model: named for model, (_, named) in alone.items()} == {m: m for m in alone}
    texts = {model: text for model, (text, _) in alone.items()}
    assert texts["zero"] == texts[MODEL]  # an adapter that changes nothing changes nothing
    assert texts["story"] != texts[MODEL]
    assert chat(client, "story", stream=True) == (texts["story"], "story")
    # All at once, streamed and not: each model's rows in the same steps as the others'
    asked = [(model, stream) for model in texts for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        together = list(pool.map(lambda a: chat(client, *a), asked))
    assert [text for text, _ in together] == [texts[model] for model, _ in asked]


def test_tgis_adapter_id_and_the_native_path_name_an_adapter(server):
    prompt = "The lighthouse keeper opened the door and"
    ask = {"prompt": prompt, "temperature": 0, "max_tokens": 16}
    client = server.openai_client()
    for model in (MODEL, "story"):
        client.completions.create(model=model, **{**ask, "max_tokens": 1})  # its prompt cached for each
    story = client.completions.create(model="story", **ask).choices[0].text
    assert story != client.completions.create(model=MODEL, **ask).choices[0].text
    tgi = requests.post(
        f"{server.url}/generate",
        json={"inputs": prompt, "parameters": {"adapter_id": "story", "max_new_tokens": 16}},
        timeout=120,
    )
    assert tgi.status_code == 200, tgi.text
    assert tgi.json()["generated_text"] == story
    native_request = {"text": prompt, "max_tokens": 16, "temperature": 0, "stream": False}
    native = requests.post(f"{server.url}/predictions/story", json=native_request, timeout=120)
    assert native.status_code == 200, native.text
    assert native.json()["text"] == story
    unknown = requests.post(
        f"{server.url}/generate", json={"inputs": prompt, "parameters": {"adapter_id": "sql"}}, timeout=10
    )
    assert unknown.status_code == 404 and "'story'" in unknown.json()["error"]


def test_a_model_that_is_neither_names_the_adapters_among_what_is_served(server):
    with pytest.raises(openai.NotFoundError) as refused:
        server.openai_client().chat.completions.create(model="sql", messages=CHAT, max_tokens=4)
    assert f"this server serves '{MODEL}' or 'zero' or 'story'" in str(refused.value)


def test_an_adapter_named_as_the_model_stops_the_server(tmp_path: Path):
    server = start_server(
        "--mock", "--served-model-name", "chat", "--lora-modules", "chat=x", log_path=tmp_path / "server.log"
    )
    try:
        assert server.process.wait(120) == 4, server.log()[-3000:]
        assert "the name 'chat' is both a --served-model-name and a --lora-modules adapter's" in server.log()
    finally:
        stop_server(server)


def test_an_adapter_loaded_while_serving_answers_at_once_and_one_unloaded_is_gone(server, adapters):
    """vLLM's runtime endpoints (--allow-runtime-lora), as the inference gateway's LoRA syncer calls them."""
    client = server.openai_client()
    story, _ = chat(client, "story")
    load = {"lora_name": "tales", "lora_path": str(adapters["story"])}
    loaded = requests.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'tales' added successfully."
    listed = {
        entry["id"]: entry for entry in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    }
    assert list(listed) == [MODEL, "zero", "story", "tales"] and listed["tales"]["parent"] == MODEL
    assert chat(client, "tales", stream=True) == (story, "tales")  # the story adapter's weights, at once

    refusals = [
        (load, 400, "a LoRA adapter named 'tales' is already loaded"),
        ({"lora_name": MODEL, "lora_path": load["lora_path"]}, 400, "is the served model's"),
        (
            {"lora_name": "sql", "lora_path": str(adapters["story"].parent)},
            400,
            "no adapter_config.json there",
        ),
        ({"lora_name": "sql"}, 400, "lora_path is required"),
    ]
    for body, status, message in refusals:
        refused = requests.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert refused.status_code == status and message in refused.json()["error"]["message"], refused.text
    # A new version under the same name (vLLM's load_inplace): the adapter that changes nothing
    in_place = {"lora_name": "tales", "lora_path": str(adapters["zero"]), "load_inplace": True}
    replaced = requests.post(f"{server.url}/v1/load_lora_adapter", json=in_place, timeout=60)
    assert replaced.status_code == 200, replaced.text
    assert chat(client, "tales") == (chat(client, MODEL)[0], "tales")
    unloaded = requests.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "tales"}, timeout=60)
    assert unloaded.status_code == 200 and "'tales' removed" in unloaded.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tales", messages=CHAT, max_tokens=4)
    again = requests.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "tales"}, timeout=60)
    assert again.status_code == 404 and "no LoRA adapter 'tales' is loaded" in again.text
    assert chat(client, "story") == (story, "story")  # the others as they were


def test_an_adapter_named_by_its_hub_id_is_downloaded_then_served_while_serving(server):
    """vLLM's lora_path may name a hub repository: the request's own thread downloads it (here from the hub
    cache, the hub offline), and the backend loads the files as it does a directory's."""
    client = server.openai_client()
    story, _ = chat(client, "story")
    load = {"lora_name": "from-hub", "lora_path": "team/story-lora"}
    loaded = requests.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert chat(client, "from-hub") == (story, "from-hub")
    missing = {"lora_name": "nowhere", "lora_path": "team/no-such-lora"}
    refused = requests.post(f"{server.url}/v1/load_lora_adapter", json=missing, timeout=60)
    message = refused.json()["error"]["message"]
    assert (
        refused.status_code == 400
        and "'nowhere' (team/no-such-lora): no directory there, and no hub" in message
    )
    unloaded = requests.post(
        f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "from-hub"}, timeout=60
    )
    assert unloaded.status_code == 200, unloaded.text
