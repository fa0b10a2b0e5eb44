"""Random-weight models: the named shapes are the real configs', weights are reproducible and
keep unit scale (clear greedy margins), and the engine runs one with a byte tokenizer."""

import pytest
import torch
from torch import nn

from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.errors import ConfigError
from icekv.model import Decoder, random_model, shape_args
from icekv.model import random
from icekv.model.weights import Int4Linear, Int8Linear, store_weights


def test_llama_31_8b_has_the_real_configs_shapes():
    args = shape_args("llama-3.1-8b")
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (32, 32, 8, 128)
    assert (args.hidden_size, args.intermediate_size, args.vocab_size) == (4096, 14336, 128256)
    with torch.device("meta"):
        model = Decoder(args)
    params = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < params < 8.1e9  # Llama-3.1-8B: 8.03 B
    assert model.layers[0].self_attn.k_proj.weight.shape == (8 * 128, 4096)


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(ConfigError, match="llama-3.1-8b"):
        shape_args("gpt-5")


def test_same_seed_same_weights_and_unit_scale_logits():
    a, b = random_model("llama-tiny", seed=3), random_model("llama-tiny", seed=3)
    c = random_model("llama-tiny", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(a.layers[0].input_layernorm.weight, torch.ones(256))
    std = a.lm_head.weight.detach().std()
    assert 0.05 < float(std) < 0.075  # 1/sqrt(256) = 0.0625


def test_weights_are_drawn_in_the_state_dict_s_order():
    """One generator draws every weight in the state dict's order, so a seed names the same
    weights however the model is built and stored."""
    model = random_model("llama-tiny", seed=2)
    with torch.device("meta"):
        meta = Decoder(shape_args("llama-tiny"))
    generator = torch.Generator().manual_seed(2)
    for key, param in meta.state_dict().items():
        want = random._drawn(key, param.shape, "cpu", generator)
        assert torch.equal(model.state_dict()[key], want), key


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16"])
def test_blocks_stored_as_drawn_equal_a_model_stored_whole(weights):
    """Drawn and stored one block at a time (what lets an 8B shape in int8 fit where its float
    weights would not), the model is the one drawn whole and then stored, tensor for tensor."""
    by_block = random_model("llama-tiny", seed=5, weights=weights)
    whole = random_model("llama-tiny", seed=5)
    store_weights(whole, weights, torch.float32)
    assert not any(isinstance(m, nn.Linear) for m in by_block.modules())
    if weights == "int4":
        assert isinstance(by_block.layers[1].mlp.down_proj, Int4Linear) and isinstance(by_block.lm_head, Int8Linear)
    mine, theirs = by_block.state_dict(), whole.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)
    assert by_block.embed_tokens.weight.dtype == torch.float32


def test_engine_decodes_a_random_model_under_full_and_icecache():
    engine = Engine(EngineConfig(random_weights="llama-tiny", device="cpu", dtype="float32"))
    assert engine.model_id == "random:llama-tiny:float32" and engine.chat_template is None
    ids = list(range(1, 400))
    sampling = SamplingConfig(max_tokens=12, ignore_eos=True)
    full = engine.generate(ids, sampling, selection=SelectionConfig(policy="full"))
    everything = engine.generate(ids, sampling, selection=SelectionConfig(policy="icecache", budget=512))
    sparse = engine.generate(ids, sampling, selection=SelectionConfig(policy="icecache", budget=64))
    assert full.new_tokens == sparse.new_tokens == 12
    assert everything.token_ids == full.token_ids  # a budget above the context attends everything
    assert sparse.kv.bytes_moved > 0
    assert engine.tokenizer.decode(engine.tokenizer.encode("héllo")) == "héllo"


def test_engine_stores_a_random_model_in_the_weights_asked_for():
    engine = Engine(EngineConfig(random_weights="llama-tiny", device="cpu", dtype="float32", weights="int8"))
    assert engine.model_id == "random:llama-tiny:float32:weights-int8"
    assert isinstance(engine.model.lm_head, Int8Linear)
    result = engine.generate(list(range(1, 100)), SamplingConfig(max_tokens=4, ignore_eos=True))
    assert result.new_tokens == 4
