import json

import pytest

from icekv.errors import ModelLoadError
from icekv.model import load_model


def test_missing_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(tmp_path)


def test_missing_weights(tmp_path):
    from tests.conftest import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def _resave(path, change):
    """Rewrite a tiny model's weights through ``change(state) -> state``."""
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    save_file(change(load_file(str(weights))), str(weights), metadata={"format": "pt"})


def test_an_extra_tensor_is_refused_by_name_unless_allowed(tmp_path):
    import torch

    from tests.conftest import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    _resave(tmp_path, lambda s: {**s, "model.layers.1.mlp.router.weight": torch.zeros(4, 128)})
    with pytest.raises(ModelLoadError, match=r"1 tensor\(s\) .* no place for: layers\.1\.mlp\.router\.weight"):
        load_model(tmp_path)
    model = load_model(tmp_path, allow_extra_weights=True)
    assert not hasattr(model.layers[1].mlp, "router")


def test_a_missing_tensor_is_refused_by_name(tmp_path):
    from tests.conftest import make_tiny_hf_model

    make_tiny_hf_model("qwen2", tmp_path)
    _resave(tmp_path, lambda s: {k: v for k, v in s.items() if k != "model.layers.2.self_attn.k_proj.bias"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 weight\(s\) of Qwen2ForCausalLM: "
                                             r"layers\.2\.self_attn\.k_proj\.bias"):
        load_model(tmp_path, allow_extra_weights=True)


def test_many_extras_are_listed_then_counted(tmp_path):
    import torch

    from tests.conftest import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    _resave(tmp_path, lambda s: {**s, **{f"vision.block{i}.weight": torch.zeros(2) for i in range(11)}})
    with pytest.raises(ModelLoadError, match=r"11 tensor\(s\).*vision\.block\d+\.weight and 3 more"):
        load_model(tmp_path)


def test_derived_tables_and_a_tied_output_matrix_are_skipped(tmp_path):
    """Rotary frequency tables (older checkpoints save them) are not weights; a tied model's saved
    output matrix is the embedding, which is what the decoder uses."""
    import json

    import torch

    from tests.conftest import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _resave(tmp_path, lambda s: {**s, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16),
                                 "lm_head.weight": torch.zeros_like(s["lm_head.weight"])})
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight and model.embed_tokens.weight.abs().sum() > 0
