"""The real Qwen2.5-Coder-0.5B-Instruct (the long-context model) against Hugging Face transformers
at 1k tokens: the Qwen2 path (qkv bias, RoPE base 1e6, untied output) on its real weights.

Runs where the model is fetched (``icekv fetch --model qwen2.5-coder-0.5b``), skipped elsewhere.
"""

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig

NAME = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.longctx_model

FULL = SelectionConfig(policy="full")  # transformers attends every token


@pytest.fixture(scope="module")
def qwen_dir(assets):
    if not assets.is_fetched(NAME):
        pytest.skip(f"{NAME} is not fetched (icekv fetch --model {NAME})")
    return assets.model_path(NAME)


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    from icekv.engine import Engine

    return Engine(EngineConfig(model_dir=NAME))


@pytest.fixture(scope="module")
def hf_model(qwen_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(qwen, essays_text):
    return qwen.tokenizer.encode(essays_text[:8000])[:1000]


def test_the_name_resolves_to_the_fetched_folder_and_its_qwen2_features(qwen, qwen_dir, hf_model):
    args, hf = qwen.model.args, hf_model.config
    assert qwen.model_dir == qwen_dir and args.architecture == "Qwen2ForCausalLM"
    assert args.qkv_bias and args.rope_theta == hf.rope_parameters["rope_theta"] == 1e6
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (24, 14, 2, 64)
    assert args.tie_word_embeddings == hf.tie_word_embeddings
    assert torch.equal(qwen.model.lm_head.weight, hf_model.lm_head.weight)
    assert qwen.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the bias was loaded, not left at 0


def test_tokenizer_matches_transformers(qwen, qwen_dir, essays_text):
    from transformers import AutoTokenizer

    text = essays_text[:6000]
    assert qwen.tokenizer.encode(text) == AutoTokenizer.from_pretrained(qwen_dir)(text)["input_ids"]


def test_logits_within_tolerance_on_1k_tokens(qwen, hf_model, prompt_ids):
    from tests.model.test_parity_tiny import _Dense

    ids = torch.tensor(prompt_ids)
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0]  # [1000, V]
        ours = qwen.model(ids, torch.arange(len(ids)), _Dense(qwen.model.args))  # [1000, V]
    assert (ours - ref).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_32_tokens_identical_through_paged_engine(qwen, hf_model, prompt_ids):
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32)[0, len(prompt_ids):]
    out = qwen.generate(prompt_ids, SamplingConfig(max_tokens=32, ignore_eos=True), selection=FULL)
    assert out.token_ids == ref.tolist()
