"""Stored weight formats against F.linear on the weight their codes stand for, over awkward shapes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from icekv.config.engine import EngineConfig
from icekv.errors import ConfigError
from icekv.model import weights
from icekv.model.linear import COMPILED_ROWS, STREAMED_ROWS
from icekv.model.random import random_model, shape_args
from icekv.model.weights import (
    INT4_GROUP, KERNEL_ROWS, BF16Linear, dense_weight, Int4Linear, Int8Linear, dequantize_int4, int4_fits, pack_nibbles,
    quantize_int4,
    quantize_int8, store_weights,
)

ROWS = (1, 3, KERNEL_ROWS, KERNEL_ROWS + 1, 40)
BF16_TOLERANCE = 0.01  # relative error of a bf16 product (inputs and output rounded to 8 bits of mantissa)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _layer(out_features: int, in_features: int, bias: bool, seed: int):
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) / in_features ** 0.5  # [out, in]
    return weight, torch.randn(out_features) if bias else None


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (33, 130), (5, 1000), (200, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_equals_its_codes_product(shape, bias):
    weight, b = _layer(*shape, bias, seed=sum(shape))
    layer = Int8Linear(weight, b)
    codes, scales = quantize_int8(weight)
    assert (codes.float() * scales[:, None] - weight).abs().max() <= scales.max() / 2 + 1e-6  # rounding, no clipping
    for rows in ROWS:
        x = torch.randn(rows, shape[1])  # [N, in]
        want = F.linear(x, codes.float() * scales[:, None], b)  # [N, out]
        assert layer(x).shape == (rows, shape[0]) and layer(x).dtype == torch.float32
        assert _relative_error(layer(x), want) < BF16_TOLERANCE, (shape, rows)


@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (32, 576), (64, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_equals_its_codes_product(shape, bias):
    weight, b = _layer(*shape, bias, seed=sum(shape))
    codes, scales, zeros = quantize_int4(weight, INT4_GROUP)
    dequantized = dequantize_int4(codes, scales, zeros)  # [out, in]
    assert int(codes.max()) <= 15 and (dequantized - weight).abs().max() <= scales.max() / 2 + 1e-6
    for kernel in (True, False):  # the CPU kernel's packed layout, and the nibbles other devices keep
        layer = Int4Linear.quantized(weight, b, nibbles=not kernel)
        assert (layer.packed is not None) == kernel
        for rows in ROWS:
            x = torch.randn(rows, shape[1])
            assert _relative_error(layer(x), F.linear(x, dequantized, b)) < BF16_TOLERANCE, (shape, rows, kernel)


def test_bf16_and_batched_inputs():
    """A [B, T, in] input keeps its leading dimensions, in every format."""
    weight, b = _layer(64, 96, True, seed=1)
    x = torch.randn(2, 5, 96)
    want = F.linear(x, weight, b)  # [2, 5, 64]
    for layer in (BF16Linear(weight, b), Int8Linear(weight, b), Int4Linear.quantized(weight, b)):
        y = layer(x)
        assert y.shape == (2, 5, 64)
        assert _relative_error(y, want) < (0.15 if isinstance(layer, Int4Linear) else 0.02)


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (203, 130), (5, 1000)])
def test_int8_decode_rows_take_the_compiled_loop_exactly_and_batch_invariantly(shape, monkeypatch):
    """Up to COMPILED_ROWS float32 rows on a CPU without bf16 units: the codes widened in the
    compiled loop, exact to float32 rounding against the weight they stand for; a row is the same
    alone or in a batch."""
    monkeypatch.setattr(weights, "bf16_units", lambda device: False)
    weight, b = _layer(*shape, True, seed=7)
    layer = Int8Linear(weight, b)
    x = torch.randn(COMPILED_ROWS, shape[1])  # [N, in]
    want = F.linear(x, layer.dequantized(torch.float32), b)  # [N, out]
    assert _relative_error(layer(x), want) < 1e-5
    alone = [layer(x[r:r + 1]) for r in range(COMPILED_ROWS)]
    assert all(torch.equal(layer(x[:n])[r:r + 1], alone[r]) for n in range(2, COMPILED_ROWS + 1) for r in range(n))


@pytest.mark.parametrize("quantize, args", [(quantize_int8, ()), (quantize_int4, (INT4_GROUP,))])
def test_row_blocks_quantize_as_one_pass(quantize, args, monkeypatch):
    monkeypatch.setattr(weights, "QUANTIZED_ROWS", 3)
    weight, _ = _layer(7, 64, False, seed=8)
    whole, blocked = quantize(weight, *args), weights.by_row_blocks(quantize, weight, *args)
    assert len(whole) == len(blocked) and all(torch.equal(a, b) for a, b in zip(whole, blocked))


def test_a_stored_model_lets_the_checkpoint_go(smollm2_dir):
    """The tensors left in the compute dtype are copies: none still points into the loaded
    checkpoint (mapped from its file), so the mapping is freed with the linear weights."""
    from icekv.model import load_model

    model = load_model(smollm2_dir)
    loaded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    store_weights(model, "int8", torch.float32)
    kept = [t for t in [*model.parameters(), *model.buffers()] if t.dtype == torch.float32]
    assert kept and not loaded & {t.untyped_storage().data_ptr() for t in kept}


def test_int4_shapes_and_fallback():
    assert int4_fits(896, 4864) and int4_fits(576, 1536) and int4_fits(96, 48)
    assert not int4_fits(100, 64) and not int4_fits(128, 20)  # no whole groups / not the kernel's blocks
    model = nn.Sequential(nn.Linear(100, 64), nn.Linear(64, 32))
    store_weights(model, "int4", torch.float32)
    assert isinstance(model[0], Int8Linear) and isinstance(model[1], Int4Linear)


@pytest.mark.parametrize("tied", [False, True])
def test_store_weights_replaces_every_linear_and_keeps_the_rest(tied):
    """A tied output layer becomes a quantized copy; the embedding it shared stays as it was."""
    from dataclasses import replace

    from icekv.model.llama import Decoder

    model = Decoder(replace(shape_args("llama-tiny"), tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    embedding, head = model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    store_weights(model, "int8", torch.float32)
    assert [m for m in model.modules() if isinstance(m, nn.Linear)] == [] and isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.float32 and torch.equal(model.embed_tokens.weight, embedding)
    codes, scales = quantize_int8(head)  # the embedding itself when tied
    assert torch.equal(dense_weight(model.lm_head), codes.bfloat16() * scales.bfloat16()[:, None])
    assert model.layers[0].input_layernorm.weight.dtype == torch.float32


def test_int4_keeps_the_output_layer_in_int8_and_takes_a_checkpoint_s_own_codes():
    model = random_model("llama-tiny")
    q_proj = model.layers[0].self_attn.q_proj
    codes = torch.randint(0, 16, q_proj.weight.shape, dtype=torch.uint8)  # [out, in]
    groups = (q_proj.out_features, q_proj.in_features // INT4_GROUP)
    scales, zeros = torch.rand(groups) / 100, torch.randn(groups) / 100
    store_weights(model, "int4", torch.float32, {"layers.0.self_attn.q_proj": (pack_nibbles(codes), scales, zeros)})
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.layers[0].mlp.up_proj, Int4Linear)
    given = model.layers[0].self_attn.q_proj
    assert isinstance(given, Int4Linear)
    want = dequantize_int4(codes, scales.bfloat16().float(), zeros.bfloat16().float())  # the kernel's bf16 scales
    assert _relative_error(dense_weight(given).float(), want) < BF16_TOLERANCE


@pytest.mark.parametrize("kind", [BF16Linear, Int8Linear, Int4Linear])
def test_dense_weight_is_the_weight_a_product_uses(kind):
    """What KV²'s normalisation reads: the stored form's weight, such that x @ w.T is its product."""
    weight, _ = _layer(32, 64, False, seed=3)
    layer = kind.quantized(weight, None) if kind is Int4Linear else kind(weight, None)
    x = torch.randn(3, 64)
    assert dense_weight(layer).shape == (32, 64)
    assert _relative_error(layer(x), F.linear(x, dense_weight(layer).float())) < BF16_TOLERANCE
    plain = nn.Linear(4, 2)
    assert dense_weight(plain) is plain.weight


def test_formats_named_by_the_compute_dtype_stay():
    model = random_model("llama-tiny")
    before = model.lm_head
    store_weights(model, "float32", torch.float32)
    assert model.lm_head is before
    with pytest.raises(ValueError, match="cannot be stored"):
        store_weights(random_model("llama-tiny", torch.bfloat16), "float32", torch.bfloat16)


def test_config_checks_and_resolves_weights():
    assert EngineConfig().weights_on("cpu") == "float32" and EngineConfig().weights_on("cuda") == "bfloat16"
    assert EngineConfig(weights="int8").weights_on("cpu") == "int8"
    with pytest.raises(ConfigError, match="weights must be one of"):
        EngineConfig(weights="int3")
    with pytest.raises(ConfigError, match="float32 weights need"):
        EngineConfig(weights="float32", dtype="bfloat16").weights_on("cpu")
    with pytest.raises(ConfigError, match="float32 weights need"):
        EngineConfig(weights="float32").weights_on("cuda")  # bfloat16 there by default
    assert EngineConfig(weights="float32").weights_on("cpu") == "float32"


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("tied", [False, True])
def test_planned_bytes_are_the_bytes_held(weights, tied):
    """The bench plan's count of a model's bytes equals what the stored model holds."""
    from dataclasses import replace

    from icekv.eval.bench_plan import model_bytes
    from icekv.model.llama import Decoder
    from icekv.model.random import shape_args

    args = replace(shape_args("llama-tiny"), tie_word_embeddings=tied)
    model = Decoder(args)
    store_weights(model, weights, torch.float32)
    held = {t.data_ptr(): t.numel() * t.element_size()
            for name, t in [*model.named_parameters(), *model.named_buffers()] if not name.startswith("rotary")}
    assert sum(held.values()) == model_bytes(args, "float32", weights)


@pytest.mark.parametrize("units", [False, True])
@pytest.mark.parametrize("kind", [BF16Linear, Int8Linear, Int4Linear])
def test_many_rows_multiply_in_bf16_only_on_bf16_units(kind, units, monkeypatch):
    """A prefill chunk's product runs in float32 on a CPU without bf16 units (exact to float32
    rounding against the weight the stored form stands for), in bfloat16 where it has them."""
    monkeypatch.setattr(weights, "bf16_units", lambda device: units)
    weight, b = _layer(48, 96, True, seed=5)
    layer = Int4Linear.quantized(weight, b, nibbles=True) if kind is Int4Linear else kind(weight, b)
    x = torch.randn(STREAMED_ROWS + 1, 96)  # [N, in]: past every few-row form
    error = _relative_error(layer(x), F.linear(x, layer.dequantized(torch.float32), b))
    assert (1e-5 < error < BF16_TOLERANCE) if units else error < 1e-6


@pytest.mark.parametrize("kind", [BF16Linear, Int8Linear, Int4Linear])
@pytest.mark.parametrize("block_rows", [1, 7, 16, 47, 48, 100])
def test_a_weight_dequantized_by_blocks_gives_the_whole_weight_s_product(kind, block_rows, monkeypatch):
    """A large weight's product of many rows is taken a block of output channels at a time (odd
    blocks, a last one cut short, one block of all): each column is the whole weight's."""
    monkeypatch.setattr(weights, "bf16_units", lambda device: False)
    weight, _ = _layer(48, 96, False, seed=7)
    layer = Int4Linear.quantized(weight, None, nibbles=True) if kind is Int4Linear else kind(weight, None)
    x = torch.randn(STREAMED_ROWS + 3, 96)  # [N, in]
    whole = F.linear(x, layer.dequantized(torch.float32))  # [N, out]
    assert torch.equal(layer.dequantized(torch.float32, 7, 30), layer.dequantized(torch.float32)[7:30])
    by_blocks = layer.dequantized_product(x, block_rows)
    assert by_blocks.shape == whole.shape and _relative_error(by_blocks, whole) < 1e-6


def test_only_a_large_weight_is_dequantized_by_blocks(monkeypatch):
    """By default the blocks are DEQUANTIZED_BLOCK_BYTES of a weight larger than
    DEQUANTIZED_WHOLE_BYTES in float."""
    monkeypatch.setattr(weights, "bf16_units", lambda device: False)
    layer = Int8Linear(_layer(48, 96, False, seed=8)[0], None)
    x = torch.randn(STREAMED_ROWS + 3, 96)  # [N, in]
    made, dequantized = [], Int8Linear.dequantized

    def recorded(self, dtype, first=0, last=None):  # the real dequantization, each row range it is asked for noted
        made.append((first, last))
        return dequantized(self, dtype, first, last)

    monkeypatch.setattr(Int8Linear, "dequantized", recorded)
    layer.dequantized_product(x)
    assert made == [(0, None)]  # 48 x 96 floats: under DEQUANTIZED_WHOLE_BYTES
    monkeypatch.setattr(weights, "DEQUANTIZED_WHOLE_BYTES", 48 * 96 * 4 - 1)
    monkeypatch.setattr(weights, "DEQUANTIZED_BLOCK_BYTES", 96 * 4 * 20)  # 20 rows
    made.clear()
    by_blocks = layer.dequantized_product(x)
    assert made == [(0, 20), (20, 40), (40, 60)]
    assert _relative_error(by_blocks, F.linear(x, layer.dequantized(torch.float32))) < 1e-6


@pytest.mark.parametrize("kind", [BF16Linear, Int8Linear])
def test_few_rows_keep_the_bf16_kernels_without_bf16_units(kind, monkeypatch):
    """A decode step reads the stored bytes through the bf16 forms, which are memory-bound."""
    monkeypatch.setattr(weights, "bf16_units", lambda device: False)
    weight, b = _layer(48, 96, True, seed=6)
    layer = kind(weight, b)
    x = torch.randn(KERNEL_ROWS, 96)  # [N, in]: past the compiled loop's rows
    error = _relative_error(layer(x), F.linear(x, layer.dequantized(torch.float32), b))
    assert 1e-5 < error < BF16_TOLERANCE
