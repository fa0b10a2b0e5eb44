"""The real SmolLM2-135M against Hugging Face transformers on real prose."""

import pytest
import torch

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig

pytestmark = pytest.mark.model

FULL = SelectionConfig(policy="full")  # transformers attends every token


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(engine, essays_text):
    return engine.tokenizer.encode(essays_text[:4000])[:500]


def test_tokenizer_matches_transformers(engine, smollm2_dir, essays_text):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = essays_text[:3000]
    assert engine.tokenizer.encode(text) == hf_tok(text)["input_ids"]


def test_logits_within_1e3_on_500_tokens(engine, hf_model, prompt_ids):
    from tests.model.test_parity_tiny import _Dense

    ids = torch.tensor(prompt_ids)
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0]  # [500, V]
    ours = engine.model(ids, torch.arange(len(ids)), _Dense(engine.model.args))  # [500, V]
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_32_tokens_identical_through_paged_engine(engine, hf_model, prompt_ids):
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32)[0, len(prompt_ids):]
    out = engine.generate(prompt_ids, SamplingConfig(max_tokens=32, ignore_eos=True), selection=FULL)
    assert out.token_ids == ref.tolist()
