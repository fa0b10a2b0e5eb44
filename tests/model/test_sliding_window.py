"""A model whose layers attend a sliding window: read from its config, and kept within the window
(which icekv does not apply yet) rather than run as a different model past it."""

import json
import shutil

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.errors import ConfigError
from icekv.model.args import ModelArgs
from tests.conftest import make_tiny_hf_model

WINDOW = 48


def test_the_window_is_read_where_a_config_turns_it_on():
    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2}
    assert ModelArgs.from_hf_config({**base, "sliding_window": 4096}).sliding_window == 4096
    assert ModelArgs.from_hf_config({**base, "sliding_window": None}).sliding_window is None
    assert ModelArgs.from_hf_config(base).sliding_window is None
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelArgs.from_hf_config({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelArgs.from_hf_config({**qwen, "use_sliding_window": True}).sliding_window == 4096
    assert ModelArgs.from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 2}).sliding_window \
        is None  # layers from index 2 on would slide: there are none
    assert ModelArgs.from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 1}).sliding_window \
        == 4096
    full = ["full_attention", "full_attention"]
    assert ModelArgs.from_hf_config({**qwen, "layer_types": full}).sliding_window is None
    assert ModelArgs.from_hf_config({**qwen, "layer_types": ["sliding_attention", "full_attention"]}).sliding_window \
        == 4096


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, smollm2_dir):
    """A tiny random Mistral with a window of WINDOW tokens and the default model's tokenizer."""
    from icekv.engine import Engine

    path = tmp_path_factory.mktemp("mistral")
    hf = make_tiny_hf_model("mistral", path, vocab_size=49152)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return hf, Engine(EngineConfig(model_dir=str(path), device="cpu"))


def test_a_request_past_the_window_is_refused(windowed):
    _, engine = windowed
    with pytest.raises(ConfigError, match=f"exceeds this model's sliding attention window of {WINDOW} tokens"):
        engine.submit(list(range(1, 41)), SamplingConfig(max_tokens=9))
    with pytest.raises(ConfigError, match=f"after a context of 30 \\+ max_tokens 9 exceeds .* window of {WINDOW}"):
        engine.check_request(10, 9, None, context_tokens=30)  # a compressed context's positions come first
    engine.check_request(10, 8, None, context_tokens=30)


def test_a_request_within_the_window_is_the_model(windowed):
    hf, engine = windowed
    ids = torch.randint(1, 49152, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    result = engine.generate(ids, SamplingConfig(max_tokens=WINDOW - 30, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=WINDOW - 30, min_new_tokens=WINDOW - 30,
                          do_sample=False)[0, 30:]
    assert result.token_ids == ref.tolist()
