"""A GGUF's 4-bit blocks read into icekv's int4 layout: the codes, scales and zeros stand for the
values gguf's own dequantization gives, over awkward shapes; llama.cpp's q/k row interleaving is
undone; only tensors that reproduce the converted model's weights are kept; an engine loads them."""

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from icekv.model.gguf_blocks import (  # noqa: E402
    BLOCKS_FILE, decode_blocks, gguf_int4_blocks, load_int4_blocks, unpermute_rows)
from icekv.model.weights import dequantize_int4, unpack_nibbles  # noqa: E402

KINDS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}  # inputs per block


def _q4_k(rng, rows: int, supers: int) -> np.ndarray:
    """Random Q4_K blocks [rows, supers * 144] (gguf has no Q4_K quantizer): d, dmin, eight 6-bit
    scales and mins packed as llama.cpp packs them, and the codes."""
    n = rows * supers
    d = (rng.uniform(1e-3, 2e-3, (n, 1))).astype(np.float16).view(np.uint8)  # [n, 2]
    dmin = (rng.uniform(1e-3, 2e-3, (n, 1))).astype(np.float16).view(np.uint8)
    sc, mn = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)  # [n, 12]
    qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return np.concatenate([d, dmin, packed, qs], axis=1).reshape(rows, supers * 144)


def _encode(rng, weight: np.ndarray, kind: str) -> np.ndarray:
    """``weight``'s blocks of ``kind`` (Q4_K: random blocks of its shape)."""
    if kind == "Q4_K":
        return _q4_k(rng, weight.shape[0], weight.shape[1] // 256)
    return quantize(weight, gguf.GGMLQuantizationType[kind])


def _values(codes, scales, zeros) -> np.ndarray:
    return dequantize_int4(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros)).numpy()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_features, blocks_in", [(1, 1), (3, 2), (17, 3)])
def test_blocks_stand_for_what_gguf_dequantizes(kind, out_features, blocks_in):
    rng = np.random.default_rng(out_features * 7 + blocks_in)
    weight = (rng.standard_normal((out_features, blocks_in * KINDS[kind])) * 0.05).astype(np.float32)
    weight[0, :5] = [0.4, -0.3, 0.0, 1e-4, -1e-4]  # an outlier-heavy group
    qtype = gguf.GGMLQuantizationType[kind]
    raw = _encode(rng, weight, kind)  # [out, bytes]
    codes, scales, zeros = decode_blocks(raw, kind, weight.shape)
    assert codes.dtype == np.uint8 and codes.shape == weight.shape and codes.max() <= 15
    assert scales.shape == zeros.shape == (out_features, weight.shape[1] // 32)
    want = dequantize(raw, qtype)  # [out, in] float32
    got = _values(codes, scales, zeros)
    if kind == "Q4_0":  # d * (q - 8): the same arithmetic
        assert np.array_equal(got, want)
    else:  # the same values, rounded once more in another order
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_other_types_have_no_int4_form():
    raw = quantize(np.zeros((1, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="Q8_0 has no int4 form"):
        decode_blocks(raw, "Q8_0", (1, 32))


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf interleaving of a Llama q / k weight's rows."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.mark.parametrize("heads, trailing", [(1, ()), (3, (5,)), (4, (2, 3))])
def test_unpermute_rows_undoes_llama_cpp_s_interleaving(heads, trailing):
    rows = np.arange(heads * 8 * int(np.prod(trailing, dtype=int))).reshape(heads * 8, *trailing)
    assert not np.array_equal(_permute(rows, heads), rows) or heads * 8 <= 2
    assert np.array_equal(unpermute_rows(_permute(rows, heads), heads), rows)


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """A GGUF of ``tensors``: name -> (raw blocks [out, bytes], type)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, (raw, kind) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_only_4_bit_tensors_that_reproduce_the_converted_weights_are_kept(tmp_path, caplog):
    """A Llama layer as transformers converts it: q (interleaved rows in the file, Q4_K), down
    (Q4_1), v (Q8_0: no int4 form), and o whose converted weight is another one (kept out)."""
    rng = np.random.default_rng(0)
    heads, kv_heads, dim = 4, 2, 256
    def normal(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    raw = {"blk.0.attn_q.weight": (_q4_k(rng, dim, 1), "Q4_K"),  # its rows interleaved, as in the file
           "blk.0.attn_k.weight": (_q4_k(rng, dim // 2, 1), "Q4_K"),  # two KV heads of four
           "blk.0.ffn_down.weight": (_encode(rng, normal(dim, 96), "Q4_1"), "Q4_1"),
           "blk.0.attn_v.weight": (_encode(rng, normal(dim // 2, dim), "Q8_0"), "Q8_0"),
           "blk.0.attn_output.weight": (_q4_k(rng, dim, 1), "Q4_K")}
    _write_gguf(tmp_path / "m.gguf", raw)
    values = {name: dequantize(r, gguf.GGMLQuantizationType[kind]) for name, (r, kind) in raw.items()}
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})

    def converted(name):  # transformers' own un-interleaving of q and k
        return processor.process(values[name], name).weights

    dequantized = {  # what transformers' conversion holds
        "model.layers.0.self_attn.q_proj.weight": converted("blk.0.attn_q.weight"),
        "model.layers.0.self_attn.k_proj.weight": converted("blk.0.attn_k.weight"),
        "model.layers.0.mlp.down_proj.weight": values["blk.0.ffn_down.weight"],
        "model.layers.0.self_attn.v_proj.weight": values["blk.0.attn_v.weight"],
        "model.layers.0.self_attn.o_proj.weight": values["blk.0.attn_output.weight"] + 0.01,  # not what the file holds
    }
    state = {name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in dequantized.items()}
    with caplog.at_level(logging.WARNING):
        blocks = gguf_int4_blocks(tmp_path / "m.gguf", state, "llama", heads, kv_heads)
    assert sorted({k.rsplit(".", 1)[0] for k in blocks}) == ["model.layers.0.mlp.down_proj.weight",
                                                             "model.layers.0.self_attn.k_proj.weight",
                                                             "model.layers.0.self_attn.q_proj.weight"]
    assert "attn_output" in caplog.text and "not kept" in caplog.text

    from safetensors.torch import save_file

    (tmp_path / "folder" / BLOCKS_FILE).parent.mkdir(parents=True)
    save_file(blocks, str(tmp_path / "folder" / BLOCKS_FILE))
    loaded = load_int4_blocks(tmp_path / "folder")
    assert sorted(loaded) == ["layers.0.mlp.down_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.q_proj"]
    for module in loaded:
        name = f"model.{module}.weight"
        want = dequantized[name]
        nibbles, scales, zeros = loaded[module]
        got = dequantize_int4(unpack_nibbles(nibbles), scales, zeros).numpy()
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert load_int4_blocks(tmp_path) == {}  # a folder without them
