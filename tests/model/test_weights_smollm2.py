"""The real SmolLM2-135M with its weights stored in bfloat16, int8 and int4, against float32."""

import copy

import pytest
import torch
import torch.nn.functional as F

from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.model.gguf_blocks import load_int4_blocks
from icekv.model.weights import Int4Linear, Int8Linear, dense_weight, store_weights
from tests.model.test_parity_tiny import _Dense

pytestmark = pytest.mark.model

# the share of 1,000 essay tokens whose next-token prediction equals float32's, at least (measured:
# 96% bf16, 94% int8, 95% int4), and the mean KL divergence from float32's, at most (0.001, 0.006,
# 0.003); int4 holds the GGUF's own 4-bit codes, which are float32's weights (dequantized from them)
AGREEMENT = {"bfloat16": (0.94, 0.003), "int8": (0.92, 0.02), "int4": (0.92, 0.01)}


@pytest.fixture(scope="module")
def essay_ids(engine, essays_text):
    return torch.tensor(engine.tokenizer.encode(essays_text[:8000])[:1000])


@pytest.mark.parametrize("weights", sorted(AGREEMENT))
def test_teacher_forced_predictions_agree_with_float32(smollm2_dir, engine, essay_ids, weights):
    positions = torch.arange(len(essay_ids))
    reference = engine.model(essay_ids, positions, _Dense(engine.model.args))  # [T, V] float32 weights
    model = copy.deepcopy(engine.model)
    store_weights(model, weights, torch.float32, load_int4_blocks(smollm2_dir))
    logits = model(essay_ids, positions, _Dense(model.args))  # [T, V]
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    kl = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="batchmean").item()
    least_agreement, most_kl = AGREEMENT[weights]
    assert agreement >= least_agreement and kl <= most_kl, (agreement, kl)


@pytest.mark.parametrize("weights, kind", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_engine_stores_and_serves_the_format(smollm2_dir, engine, weights, kind):
    """``weights`` reaches the model, names the model's identity (stored KV differs per format), and
    the greedy answer to a short prompt starts as float32's (" Paris.")."""
    quantized = Engine(EngineConfig(model_dir=str(smollm2_dir), weights=weights))
    assert isinstance(quantized.model.layers[0].mlp.down_proj, kind)
    assert quantized.model_id != engine.model_id and weights in quantized.model_id
    assert isinstance(quantized.model.lm_head, Int8Linear)  # int4 too: the output layer stays in int8
    if weights == "int4":  # the converted GGUF's own 4-bit codes: float32's weights but for bf16 scales
        assert quantized.model_id.endswith("weights-int4-gguf")
        stored = dense_weight(quantized.model.layers[0].self_attn.q_proj).float()
        weight = engine.model.layers[0].self_attn.q_proj.weight
        assert (stored - weight).norm() / weight.norm() < 0.01
    sampling, full = SamplingConfig(max_tokens=8, ignore_eos=True), SelectionConfig(policy="full")
    prompt = "The capital of France is"
    want = engine.generate(prompt, sampling, selection=full).token_ids
    got = quantized.generate(prompt, sampling, selection=full).token_ids
    assert got[:2] == want[:2]
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    context = quantized.compress(ids, "kv2", 0.25, normalize=True)  # KV²+ reads the output projections
    assert 0 < context.nbytes < context.full_bytes
