"""The transformers peer of a random-weight model is the same model: same logits as icekv's."""

import torch

from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.eval.decode_bench import hf_decode
from icekv.eval.hf_peer import hf_model


def test_transformers_peer_of_a_random_model_gives_icekvs_logits():
    engine = Engine(EngineConfig(random_weights="llama-tiny", device="cpu"))
    ids = list(range(1, 300))  # past the Llama 3 RoPE's low-frequency cut: its scaling matters
    with torch.no_grad():
        theirs = hf_model(engine)(input_ids=torch.tensor([ids])).logits[0, -1]  # [V]
    ours = engine.prefill(ids)
    torch.testing.assert_close(ours.logits, theirs, rtol=1e-4, atol=1e-4)
    tpot, tokens = hf_decode(engine, ours, steps=3)  # the timed peer decodes what icekv decodes
    full = engine.decode(ours, SamplingConfig(max_tokens=5, ignore_eos=True), SelectionConfig(policy="full"))
    assert tokens == full.token_ids and tpot > 0
