"""A GGUF file's layers served from its blocks never load as floats (model/lean_load.py): they load as
placeholders, their dense copies for many rows are made from the blocks one layer at a time while the
calibration asks for them, and those it keeps are the file's own weights."""

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.model import gguf_conversion, loader
from backend.model.gguf_conversion import omitted_weights
from backend.model.lean_load import state_dict_without
from backend.model.resources import InsufficientResources
from backend.model.source import default_model_path
from backend.quant import block_weights, calibration
from backend.quant.quantized_linear import WeightOnlyLinear, quantizable_linears
from tests.backend.gguf_files import q4_k_m, write_tiny_gguf
from tests.backend.models import load_on_cpu, tiny_model
from tests.backend.test_gguf_families import FAMILIES, Q4_0, random_norms

pytestmark = pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="a lean load needs the CPU's blocks (AVX2 or AVX-512 VNNI); elsewhere the layers load as floats",
)


def spy_lean_loads(monkeypatch) -> list:
    """Each (model, placeholder layers) a lean load gives, as it gives it (before its layers are served)."""
    loads, load_lean = [], loader.load_lean

    def spying(*args):
        loaded = load_lean(*args)
        if loaded is not None:
            model, _, _, layers = loaded
            loads.append((model, set(layers)))
            assert set(placeholders(model)) == {f"{name}.weight" for name in layers}
        return loaded

    monkeypatch.setattr(loader, "load_lean", spying)
    return loads


def placeholders(model: torch.nn.Module) -> list[str]:
    return [name for name, parameter in model.named_parameters() if 0 in parameter.stride()]


def calibrate_alike(monkeypatch, max_error: float = calibration.MAX_ERROR) -> None:
    """The calibration's choices made the same whatever this CPU's timings: every copy for many rows pays
    off, int8 too where within `max_error`, and many rows from the fewest timed."""
    monkeypatch.setattr(calibration, "COPY_MIN_SPEEDUP", 0.0)
    monkeypatch.setattr(calibration, "int8_multiplies_faster", lambda layer: True)
    monkeypatch.setattr(calibration, "MAX_ERROR", max_error)
    monkeypatch.setattr(calibration, "PROJECTION_TIMED_ROWS", (16,))
    monkeypatch.setattr(calibration, "HEAD_TIMED_ROWS", (16,))


def q4_k_m_file(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    return write_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf", model, default_model_path(), q4_k_m), model


def test_the_served_layers_load_as_placeholders_and_the_copies_kept_are_the_files_weights(
    tmp_path, monkeypatch
):
    """Every projection of a Q4_K_M file loads as a placeholder (no memory) and nothing else does; with
    every dense copy kept (int8 never within the error allowed), each copy is the file's dequantized
    weight, as the exact mode loads it, and no layer is left making its copy on demand."""
    path, original = q4_k_m_file(tmp_path)
    exact = dict(load_on_cpu(path, tmp_path).model.named_parameters())
    loads = spy_lean_loads(monkeypatch)
    calibrate_alike(monkeypatch, max_error=0.0)  # no int8 path is close enough: every copy stays
    served = load_on_cpu(path, tmp_path, quantize="auto").model
    ((model, layers),) = loads
    assert model is served
    assert layers == set(quantizable_linears(original))
    layers_served = {name: m for name, m in served.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert layers <= layers_served.keys()
    assert not placeholders(served)
    for name in layers:
        layer = layers_served[name]
        assert layer.dense_on_demand is None and layer.dense is not None, name
        assert torch.equal(layer.dense, exact[f"{name}.weight"].to(layer.dense.dtype)), name


def test_a_calibration_pass_holds_one_copy_made_on_demand_at_a_time(tmp_path, monkeypatch):
    """While the calibration passes make the dense copies from the blocks, at most one layer holds one it
    has not kept: all at once they were 2 bytes a parameter beside the blocks, most of a 1B Q4_K_M file's
    load peak. Where int8 is within the error allowed, its copy goes."""
    path, _ = q4_k_m_file(tmp_path)
    load_on_cpu(path, tmp_path)  # the converted copy, which the next start loads without the layers
    loads = spy_lean_loads(monkeypatch)
    calibrate_alike(monkeypatch, max_error=1.0)  # every int8 path is close enough
    held, dense_copy = [], block_weights.dense_copy

    def counting(blocks, in_features, dtype, table=False):
        ((model, _),) = loads
        modules = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
        held.append(sum(m.dense is not None and m.dense_on_demand is not None for m in modules))
        return dense_copy(blocks, in_features, dtype, table)

    monkeypatch.setattr(block_weights, "dense_copy", counting)
    served = load_on_cpu(path, tmp_path, quantize="auto").model
    assert len(held) >= 2 * len(loads[0][1])  # the pass that measures inputs, and the one that smooths
    assert max(held) <= 1
    projections = [m for m in served.model.layers.modules() if isinstance(m, WeightOnlyLinear)]
    assert all(m.dense is None and m.dense_int8 is not None for m in projections)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "phi3", "gemma2", "mixtral"])
def test_each_familys_file_loads_lean_and_serves_what_its_floats_serve(family, tmp_path, monkeypatch):
    """A later start of each family's Q4_0 file (its converted copy, a tensor at a time or whole) loads
    its projections as placeholders, replaces every one, and gives the logits of a step of few rows (the
    blocks' path) and of many (the copies' or int8's path, calibrated alike) that a load of the floats
    gives."""
    torch.manual_seed(0)
    model = random_norms(FAMILIES[family]())
    path = write_tiny_gguf(tmp_path / f"tiny-{family}-Q4_0.gguf", model, default_model_path(), Q4_0)
    calibrate_alike(monkeypatch)
    monkeypatch.setattr(loader, "load_lean", lambda *args: None)
    floats = load_on_cpu(path, tmp_path, quantize="auto").model
    monkeypatch.undo()
    calibrate_alike(monkeypatch)
    loads = spy_lean_loads(monkeypatch)
    served = load_on_cpu(path, tmp_path, quantize="auto").model
    assert len(loads) == 1 and loads[0][1], family
    assert not placeholders(served)
    few = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
    many = torch.arange(2, 50).reshape(1, -1)  # a prompt of 48 tokens
    with torch.inference_mode():
        for ids in (few, many):
            assert torch.equal(served(ids).logits, floats(ids).logits), (family, ids.shape)


def copy_weights(converted: Path) -> dict[str, torch.Tensor]:
    """Every weight a converted copy holds, from each of its shards."""
    return {
        name: t
        for shard in sorted(converted.glob("model-*.safetensors"))
        for name, t in load_file(shard).items()
    }


def the_copy(cache: Path) -> Path:
    (converted,) = (cache / "converted").iterdir()
    return converted


def test_a_lean_first_start_leaves_its_blocks_layers_out_of_the_copy_and_a_start_that_reads_them_adds_them(
    tmp_path, monkeypatch
):
    """A default-mode first start on a CPU that multiplies blocks writes a converted copy without the
    floats of the layers the blocks serve (4 bytes a parameter on disk that no lean start reads), and
    its disk check counts so; a later lean start loads from it alike. An exact-mode start first writes
    them into it: the copy is then the whole conversion's, weight for weight, and serves as it does."""
    path, original = q4_k_m_file(tmp_path)
    projections = {f"{name}.weight" for name in quantizable_linears(original)}
    checked, check_resources = [], loader.check_resources
    monkeypatch.setattr(
        loader, "check_resources", lambda *a, **k: checked.append(k) or check_resources(*a, **k)
    )
    calibrate_alike(monkeypatch)
    lean = load_on_cpu(path, tmp_path, quantize="auto").model
    converted = the_copy(tmp_path / "cache")
    assert set(omitted_weights(converted)) == projections
    assert not projections & copy_weights(converted).keys()
    assert checked[0]["left_to_blocks"] == sum(original.get_parameter(name).numel() for name in projections)
    loads = spy_lean_loads(monkeypatch)
    again = load_on_cpu(path, tmp_path, quantize="auto").model
    assert len(loads) == 1 and loads[0][1] == {name.removesuffix(".weight") for name in projections}
    prompt = torch.arange(2, 50).reshape(1, -1)
    with torch.inference_mode():
        assert torch.equal(again(prompt).logits, lean(prompt).logits)
    # A CPU whose blocks served fewer of the layers would load it as floats, once they are written
    fewer = {name.removesuffix(".weight") for name in projections} - {"model.layers.0.mlp.down_proj"}
    assert state_dict_without(converted, torch.float32, fewer, original) is None

    exact = load_on_cpu(path, tmp_path).model
    assert omitted_weights(converted) == []
    whole = load_on_cpu(path, tmp_path / "whole").model  # an exact first start: the whole copy at once
    completed, written_whole = copy_weights(converted), copy_weights(the_copy(tmp_path / "whole" / "cache"))
    assert completed.keys() == written_whole.keys() >= projections
    assert all(torch.equal(completed[name], written_whole[name]) for name in completed)
    with torch.inference_mode():
        assert torch.equal(exact(prompt).logits, whole(prompt).logits)


def test_a_copy_the_disk_will_not_complete_is_refused_so_and_left_as_it_was(tmp_path, monkeypatch):
    """Where the disk fills while the layers a lean start left out are written into its copy, the start
    is refused, saying so; the shards written are removed, and the copy serves lean starts as before."""
    path, _ = q4_k_m_file(tmp_path)
    load_on_cpu(path, tmp_path, quantize="auto")
    converted = the_copy(tmp_path / "cache")
    before = {file.name: file.stat().st_size for file in converted.iterdir()}
    save_file, saved = gguf_conversion.save_file, []

    def filling(tensors: dict, filename: Path, metadata: dict) -> None:
        if len(saved) == 2:  # the third shard finds the disk full, part written
            Path(filename).write_bytes(b"part")
            raise OSError(errno.ENOSPC, "No space left on device")
        saved.append(filename)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(gguf_conversion, "SHARD_BYTES", 1)  # a shard a weight
    monkeypatch.setattr(gguf_conversion, "save_file", filling)
    with pytest.raises(InsufficientResources, match="the disk would not take them: free some disk space"):
        load_on_cpu(path, tmp_path)
    assert len(saved) == 2
    assert {file.name: file.stat().st_size for file in converted.iterdir()} == before
    monkeypatch.undo()
    loads = spy_lean_loads(monkeypatch)
    load_on_cpu(path, tmp_path, quantize="auto")
    assert len(loads) == 1
