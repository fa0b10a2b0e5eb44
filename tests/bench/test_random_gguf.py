"""bench/peers' random-weight shapes: the config.json vLLM builds its dummy model from, and the GGUF
of random Q8_0 blocks llama.cpp loads, read back with gguf's own reader (llama.cpp itself runs in
the bench, in its own venv)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from icekv.model import shape_args

gguf = pytest.importorskip("gguf")
PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_random_gguf_has_the_shape_s_tensors_and_scales(tmp_path):
    run, random_gguf = _module("run"), _module("random_gguf")
    args = shape_args("llama-tiny")
    config = run.hf_config(args, "llama-tiny")
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)
    path = tmp_path / "tiny.gguf"
    random_gguf.write(json.loads(json.dumps(config)), path)  # as the bench passes it: through a file
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 9 * args.num_layers + 1
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    weight = gguf.dequantize(q.data, q.tensor_type)  # [out, in]
    assert weight.shape == (args.num_heads * args.head_dim, args.hidden_size)
    assert abs(float(weight.std()) * args.hidden_size ** 0.5 - 1) < 0.05  # std 1/sqrt(fan_in), as icekv draws
    down = gguf.dequantize(tensors["blk.3.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    assert down.shape == (args.hidden_size, args.intermediate_size)
    embedding = gguf.dequantize(tensors["token_embd.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    assert embedding.shape == (args.vocab_size, args.hidden_size) and abs(float(embedding.std()) - 1) < 0.05
    assert np.array_equal(tensors["output_norm.weight"].data, np.ones(args.hidden_size, dtype=np.float32))
    assert not np.array_equal(weight[0], weight[1])  # drawn, not repeated
    fields = reader.fields
    assert int(fields["llama.block_count"].parts[-1][0]) == args.num_layers
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == args.num_kv_heads
    assert len(fields["tokenizer.ggml.tokens"].data) == args.vocab_size


def test_random_prompt_ids_are_seeded_and_in_the_vocabulary():
    run = _module("run")
    args = shape_args("llama-tiny")
    a, b = run.random_prompt_ids(args, 300), run.random_prompt_ids(args, 300)
    assert a == b and len(a["prompt"]) == 300 and len(a["follow_up"]) == run.FOLLOW_UP_TOKENS
    assert 0 <= min(a["prompt"]) and max(a["prompt"]) < args.vocab_size
    assert run.random_prompt_ids(args, 300, seed=1) != a
