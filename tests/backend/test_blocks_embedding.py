"""An input embedding takes its rows from blocks (blocks_embedding.py), a tied head's or, where the file
keeps it quantized, its own: the same floats, bit for bit, without the float copy."""

import copy

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from backend.quant import block_weights
from backend.quant.block_weights import Layout, dense_copy
from backend.quant.blocks_embedding import BlocksEmbedding, serve_from_tied_head
from backend.quant.gguf_weights import serve_gguf_weights
from backend.quant.quantized_linear import Int8Linear, resident_bytes
from tests.backend.k_quants import quantize
from tests.backend.models import tiny_model, write_gguf_linears
from tests.backend.test_block_weights import LAYOUT_IDS, LAYOUTS, inputs_of, packed

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not block_weights.available(CPU), reason="this CPU has no AVX2 (or no compiler): heads are not in blocks"
)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rows_are_the_dense_copys_rows(layout, dtype):
    """Any rows, in any order, repeated, from every group of 16 and every place in one, in the shape of the
    ids: the rows of the dense copy of the same blocks, bit for bit."""
    out_features, in_features = 80, inputs_of(layout, 3)
    blocks, _ = packed(layout, out_features, in_features)
    embedding = BlocksEmbedding(blocks, in_features, dtype, layout.table)
    whole = dense_copy(blocks, in_features, dtype, layout.table)
    ids = torch.tensor([[79, 0, 15, 16], [31, 31, 64, 3]])
    got = embedding(ids)
    assert got.dtype == dtype and got.shape == (2, 4, in_features)
    assert torch.equal(got, whole[ids])
    assert torch.equal(embedding(torch.arange(out_features)), whole)
    assert embedding(torch.empty(0, dtype=torch.long)).shape == (0, in_features)


def test_a_row_the_blocks_do_not_hold_is_refused():
    blocks, _ = packed(Layout(4), 32, 64)
    embedding = BlocksEmbedding(blocks, 64, torch.bfloat16)
    for row in (32, -1):
        with pytest.raises(RuntimeError, match=f"row {row} is not among the 32 rows the blocks hold"):
            embedding(torch.tensor([0, row]))


def test_compiled_code_looks_rows_up_as_an_operator():
    """torch.compile (--compile) traces the lookup as a custom operator, with no graph break."""
    blocks, _ = packed(Layout(6, super_blocks=True), 32, 256)
    embedding = BlocksEmbedding(blocks, 256, torch.bfloat16)
    ids = torch.tensor([3, 17, 3])
    compiled = torch.compile(lambda ids: embedding(ids) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(ids), embedding(ids) * 2)


def tied_model_with_head_in_blocks(tie: bool = True) -> nn.Module:
    """A tiny Llama (tied or not) whose head multiplies by 8-bit blocks, its floats the dense copy."""
    model = tiny_model("llama", tie_word_embeddings=tie).to(torch.bfloat16)
    head = model.lm_head
    q = torch.randint(-127, 128, head.weight.shape, dtype=torch.int8)
    scale = (torch.rand(head.weight.shape[0], head.weight.shape[1] // 32) / 100).half().float()
    weight = (q.float().reshape(*q.shape[0:1], -1, 32) * scale[..., None]).reshape(q.shape)
    with torch.no_grad():
        head.weight.copy_(weight)  # the embedding too, where tied
    model.lm_head = Int8Linear(q, scale, None, dense=head.weight.detach())
    return model


def test_a_tied_heads_blocks_serve_the_embedding_and_the_floats_go():
    """The model's hidden states are what they were; the embedding's floats (the head's dense copy) are
    let go, the head multiplies every number of rows by its blocks (18 here, which took the copy), and the
    blocks count once, as quantized."""
    model = tied_model_with_head_in_blocks()
    floats_before = resident_bytes(model)["floats"]
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.inference_mode():
        before = model.model(ids).last_hidden_state
        logits_before = model(ids).logits
    embedding_bytes = model.get_input_embeddings().weight.untyped_storage().nbytes()
    assert model.lm_head.dense_from_rows == 6  # the copy would multiply 6 rows or more (untimed here)
    assert serve_from_tied_head(model, rows=5)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, BlocksEmbedding) and embedding.blocks is model.lm_head.blocks
    assert model.lm_head.dense is None and not model.lm_head.has_many_rows_path
    with torch.inference_mode():
        hidden = model.model(ids).last_hidden_state
        assert torch.equal(hidden, before)
        logits = model(ids).logits
    assert torch.equal(logits, model.lm_head.packed_matmul(hidden.reshape(18, -1)).reshape(logits.shape))
    assert (logits - logits_before).abs().max() < 0.02 * logits_before.abs().max()
    resident = resident_bytes(model)
    assert resident["floats"] == floats_before - embedding_bytes
    assert resident["quantized"] == model.lm_head.blocks.untyped_storage().nbytes()


def test_the_embedding_keeps_its_floats_unless_the_blocks_hold_them_and_the_copy_does_not_pay():
    """Not where the head is not tied to it, has no blocks, or has no dense copy (nothing says the
    blocks hold the embedding); not where the copy would multiply a step's rows (the loader timed it
    faster there); not where the blocks hold other weights than its floats (a type requantized to 8-bit
    blocks), even in one value of its last row."""
    untied = tied_model_with_head_in_blocks(tie=False)
    assert not serve_from_tied_head(untied, 5) and type(untied.get_input_embeddings()) is nn.Embedding
    floats = tiny_model("llama", tie_word_embeddings=True)
    assert not serve_from_tied_head(floats, 5) and type(floats.get_input_embeddings()) is nn.Embedding
    no_copy = tied_model_with_head_in_blocks()
    no_copy.lm_head.drop_dense()
    assert not serve_from_tied_head(no_copy, 5)
    paying = tied_model_with_head_in_blocks()
    assert not serve_from_tied_head(paying, rows=6) and paying.lm_head.dense is not None
    other = tied_model_with_head_in_blocks()
    with torch.no_grad():
        other.get_input_embeddings().weight[-1, -1] += 1
    assert not serve_from_tied_head(other, 5)
    assert type(other.get_input_embeddings()) is nn.Embedding and other.lm_head.dense is not None


def test_blocks_of_another_width_are_refused():
    blocks, _ = packed(Layout(4), 32, 64)
    with pytest.raises(ValueError, match="no blocks of 96 inputs"):
        BlocksEmbedding(blocks, 96, torch.bfloat16)


EMBEDDING_TYPES = [
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_XS,
]


@pytest.mark.parametrize("kind", EMBEDDING_TYPES, ids=lambda kind: kind.name)
def test_an_untied_embedding_the_file_keeps_quantized_is_served_from_its_own_blocks(
    kind, tmp_path, caplog, monkeypatch
):
    """A model with a head of its own whose file keeps the input embedding quantized (Llama 3.1 8B's
    Q4_K_M: Q4_K): its rows from the embedding's own blocks, bit for bit the floats transformers loads
    (the file's dequantized table), from the file and then from the copy of its blocks, packed a part of
    its rows at a time (here 48 of 512); the log says so."""
    monkeypatch.setattr(block_weights, "PACK_CHANNELS", 48)
    wide = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quants' rows are blocks of 256
    model = tiny_model("llama", tie_word_embeddings=False, **wide)
    kinds = {"self_attn": GGMLQuantizationType.Q8_0, "mlp": GGMLQuantizationType.Q8_0}
    path = write_gguf_linears(tmp_path / "untied.gguf", model, kinds, embedding=kind)
    table = model.get_input_embeddings().weight.detach().numpy()
    with torch.no_grad():  # the floats a load from the file starts with
        model.get_input_embeddings().weight.copy_(
            torch.from_numpy(quants.dequantize(quantize(table, kind), kind))
        )
    ids = torch.tensor([[0, 511, 17], [16, 15, 17]])
    expected = model.get_input_embeddings()(ids)
    for start in range(2):  # the file, then the copy of its blocks beside it
        served = copy.deepcopy(model)
        with caplog.at_level("INFO"):
            serve_gguf_weights(served, path, tmp_path)
        embedding = served.get_input_embeddings()
        assert isinstance(embedding, BlocksEmbedding), start
        assert torch.equal(embedding(ids), expected)
        said = f"output head (F32) as floats; input embedding from its {embedding.layout.name()}"
        assert f"(with the norms) to torch.float32; {said}" in caplog.text
        assert type(served.lm_head) is nn.Linear  # the head's float32: as the file keeps it
        caplog.clear()


@pytest.mark.parametrize("vocab", [512, 500], ids=["other floats", "a vocabulary of no whole groups"])
def test_an_untied_embedding_keeps_its_floats_where_its_blocks_do_not_serve_them(vocab, tmp_path):
    """Floats that are not the blocks' (a model loaded from elsewhere than this file) stay as they are, and
    so do those of a vocabulary that no blocks take (rows not a multiple of 16)."""
    model = tiny_model("llama", tie_word_embeddings=False, vocab_size=vocab)
    kinds = {"self_attn": GGMLQuantizationType.Q8_0, "mlp": GGMLQuantizationType.Q8_0}
    path = write_gguf_linears(tmp_path / "untied.gguf", model, kinds, embedding=GGMLQuantizationType.Q8_0)
    if vocab % 16:  # the floats the file holds: only the shape keeps them
        table = model.get_input_embeddings().weight.detach().numpy()
        dequantized = quants.dequantize(quantize(table, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(torch.from_numpy(dequantized))
    serve_gguf_weights(model, path, tmp_path)  # (512: the random floats, not the Q8_0 ones)
    assert type(model.get_input_embeddings()) is nn.Embedding
