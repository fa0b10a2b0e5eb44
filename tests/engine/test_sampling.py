"""Penalties and biases on the logits, as OpenAI and vLLM define them, and through the engine."""

import pytest
import torch

from icekv.config.request import SamplingConfig
from icekv.engine.sampling import adjusted_logits
from icekv.errors import ConfigError

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
NONE = torch.tensor([], dtype=torch.long)


def test_neutral_settings_leave_the_logits_as_they_are():
    cfg = SamplingConfig()
    assert not cfg.adjusts_logits
    assert torch.equal(adjusted_logits(LOGITS, cfg, torch.tensor([0, 1]), torch.tensor([3, 3])), LOGITS)


def test_frequency_counts_each_generation_presence_only_the_first():
    cfg = SamplingConfig(frequency_penalty=0.5, presence_penalty=1.0)
    out = adjusted_logits(LOGITS, cfg, torch.tensor([1]), torch.tensor([3, 3, 0]))  # the prompt does not count
    assert out.tolist() == [2.0 - 0.5 - 1.0, -1.0, 0.5, 3.0 - 1.0 - 1.0, -2.0]


def test_repetition_penalty_shrinks_every_seen_tokens_logit_towards_unlikely():
    cfg = SamplingConfig(repetition_penalty=2.0)
    out = adjusted_logits(LOGITS, cfg, torch.tensor([1, 0]), torch.tensor([3]))
    assert out.tolist() == [1.0, -2.0, 0.5, 1.5, -2.0]


def test_logit_bias_adds_to_the_named_tokens():
    out = adjusted_logits(LOGITS, SamplingConfig(logit_bias=((4, 100.0), (0, -1.5))), NONE, NONE)
    assert out.tolist() == [0.5, -1.0, 0.5, 3.0, 98.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in"),
    ({"logit_bias": ((5, 101.0),)}, "logit_bias maps"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias maps"),
])
def test_out_of_range_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingConfig(**kwargs)


def test_through_the_engine_a_bias_forces_a_token_and_a_penalty_stops_a_repeat(engine):
    prompt = "one one one one one one one"
    plain = engine.generate(prompt, SamplingConfig(max_tokens=6, ignore_eos=True))
    target = engine.tokenizer.encode(" banana")[0]
    forced = engine.generate(prompt, SamplingConfig(max_tokens=6, ignore_eos=True, logit_bias=((target, 100.0),)))
    assert forced.token_ids == [target] * 6
    repeated = max(set(plain.token_ids), key=plain.token_ids.count)
    penalised = engine.generate(prompt, SamplingConfig(max_tokens=6, ignore_eos=True, frequency_penalty=2.0,
                                                       presence_penalty=2.0))
    assert penalised.token_ids.count(repeated) < plain.token_ids.count(repeated)
    with pytest.raises(ConfigError, match="vocabulary has"):
        engine.submit(prompt, SamplingConfig(logit_bias=((10**7, 1.0),)))


def test_logprobs_are_the_models_log_softmax_at_each_step(engine):
    prompt = engine.tokenizer.encode("The capital of France is")
    out = engine.generate(prompt, SamplingConfig(max_tokens=4, ignore_eos=True, logprobs=3))
    assert [t["token_id"] for t in out.logprobs] == out.token_ids
    for i, entry in enumerate(out.logprobs):
        ref = engine.prefill(prompt + out.token_ids[:i])  # the same position's logits, by a prefill
        try:
            logprobs = torch.log_softmax(ref.logits.float(), -1)
        finally:
            engine.release(ref)
        assert entry["logprob"] == pytest.approx(float(logprobs[entry["token_id"]]), abs=1e-3)
        best = torch.topk(logprobs, 3)
        assert [a["token_id"] for a in entry["top_logprobs"]] == best.indices.tolist()  # greedy: the first is it
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]
        assert entry["token"] == engine.tokenizer.decode([entry["token_id"]])
    assert engine.generate(prompt, SamplingConfig(max_tokens=2)).logprobs == []  # not asked: none


def test_prompt_logprobs_score_every_prompt_token_after_the_first_across_chunks(smollm2_dir):
    from icekv.config.engine import EngineConfig
    from icekv.engine import Engine

    small_chunks = Engine(EngineConfig(model_dir=str(smollm2_dir), prefill_chunk_tokens=7))
    prompt = small_chunks.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    out = small_chunks.generate(prompt, SamplingConfig(max_tokens=1, prompt_logprobs=2))
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0]["logprob"] is None
    assert out.prompt_logprobs[0]["token_id"] == prompt[0]
    for p in (1, 5, 7, 8, len(prompt) - 1):  # inside a chunk and on both sides of chunk bounds
        ref = small_chunks.prefill(prompt[:p])
        try:
            want = torch.log_softmax(ref.logits.float(), -1)
        finally:
            small_chunks.release(ref)
        entry = out.prompt_logprobs[p]
        assert entry["token_id"] == prompt[p]
        assert entry["logprob"] == pytest.approx(float(want[prompt[p]]), abs=1e-3)
        assert [a["token_id"] for a in entry["top_logprobs"]] == torch.topk(want, 2).indices.tolist()
    assert out.cached_tokens == 0  # scored prompts are never served from the prefix cache
