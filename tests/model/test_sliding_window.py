"""Models whose layers attend a sliding window (Mistral: every layer; Gemma 3: most layers, local,
beside global ones), read from their configs and run by the engine as transformers runs them:
through chunked prefill, the batched paged decode, the prefix cache and a sparse policy."""

import shutil
from dataclasses import replace

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError, ModelLoadError
from icekv.model.args import ModelArgs
from tests.conftest import make_tiny_hf_model

VOCAB = 49152  # the default model's tokenizer
PROMPT, NEW = 70, 30  # well past the tiny configs' window of 24 tokens


def _args(**cfg) -> ModelArgs:
    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 2, "num_attention_heads": 2}
    return ModelArgs.from_hf_config({**base, **cfg})


def test_the_local_layers_are_read_where_a_config_turns_them_on():
    assert _args(sliding_window=4096).local_layers == (0, 1) and _args(sliding_window=4096).window(1) == 4096
    assert _args(sliding_window=None).local_layers == () and _args().window(0) is None
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert _args(**qwen, use_sliding_window=False).local_layers == ()
    assert _args(**qwen, use_sliding_window=True).local_layers == (0, 1)
    assert _args(**qwen, use_sliding_window=True, max_window_layers=1).local_layers == (1,)  # from index 1 on
    assert _args(**qwen, layer_types=["sliding_attention", "full_attention"]).local_layers == (0,)
    assert _args(**qwen, layer_types=["full_attention"] * 2).sliding_window is None


def test_gemma_3_s_layout_and_rope_bases_are_read_from_either_config_form():
    old = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 12,
           "sliding_window": 512, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh"}
    args = _args(**old)  # Gemma 3's config.json as released: every sixth layer global
    assert args.global_layers == (5, 11) and args.window(4) == 512 and args.window(5) is None
    assert (args.rope_theta, args.local_rope_theta, args.rope_scaling) == (1e6, 1e4, {"rope_type": "linear",
                                                                                      "factor": 8.0})
    assert args.gemma_norms and args.qk_norm and args.mlp_activation == "gelu_tanh" and args.tie_word_embeddings
    assert args.query_pre_attn_scalar == 256.0
    assert _args(**old, sliding_window_pattern=4).global_layers == (3, 7, 11)


@pytest.mark.parametrize("cfg, refusal", [
    ({"architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM: Gemma 2 soft-caps its attention logits"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "image-text checkpoint"),
    ({"final_logit_softcapping": 30.0}, "unsupported logit soft-capping"),
    ({"hidden_act": "relu"}, "unsupported MLP activation 'relu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
])
def test_what_icekv_cannot_run_is_refused_by_name(cfg, refusal):
    with pytest.raises(ModelLoadError, match=refusal):
        _args(**cfg)


@pytest.fixture(scope="module", params=["mistral-window", "gemma3"])
def windowed(request, tmp_path_factory, smollm2_dir):
    """(transformers' model, its folder) of a tiny random model whose layers attend 24 tokens."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_hf_model(request.param, path, vocab_size=VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return hf, path


def _prompts(n: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (PROMPT + 9 * i,), generator=generator).tolist() for i in range(n)]


def _greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


PAGE = 8


def _engine(path):
    """Pages of 8 tokens, prompts prefilled 32 tokens a step: windows cross both."""
    from icekv.engine import Engine

    return Engine(EngineConfig(model_dir=str(path), device="cpu", prefill_chunk_tokens=32,
                               paging=PagingConfig(page_size=PAGE, pool_tokens=1024),
                               selection=SelectionConfig(page_size=PAGE)))


def _run_together(engine, prompts, selection=None):
    """Greedy tokens of ``prompts`` decoded in the same steps (one batched paged decode)."""
    seqs = [engine.submit(ids, SamplingConfig(max_tokens=NEW, ignore_eos=True), selection) for ids in prompts]
    while not all(seq.done for seq in seqs):
        engine.step()
    return [engine.run(seq).token_ids for seq in seqs]


def test_chunked_prefill_and_batched_decode_past_the_window_are_the_model(windowed, monkeypatch):
    """Both requests decode every layer, local ones past their window too, in the one batched
    paged decode of each step, each from its own window's first token."""
    import icekv.engine.decode_plan as decode_plan

    hf, path = windowed
    engine = _engine(path)
    prompts = _prompts(2)
    batches = []

    def batched(q, pool_layer, table, **kwargs):
        batches.append((table.batch_size, kwargs["first_visible"]))
        return paged_decode_attention(q, pool_layer, table, **kwargs)

    paged_decode_attention = decode_plan.paged_decode_attention
    monkeypatch.setattr(decode_plan, "paged_decode_attention", batched)
    assert _run_together(engine, prompts) == [_greedy(hf, ids) for ids in prompts]
    args = ModelArgs.from_dir(path)
    local = [seen for size, seen in batches if size == 2 and seen is not None]
    assert len(local) == (NEW - 1) * len(args.local_layers)  # every decode step after the first token
    assert all(seen.tolist() == [n - args.sliding_window for n in (PROMPT + k, PROMPT + 9 + k)]
               for k, seen in enumerate(local[::len(args.local_layers)], start=1))


def test_a_prefix_cache_hit_past_the_window_is_the_model(windowed):
    hf, path = windowed
    engine = _engine(path)
    first, = _prompts(1)
    engine.generate(first, SamplingConfig(max_tokens=4))
    longer = first + _prompts(2)[1][:20]
    result = engine.generate(longer, SamplingConfig(max_tokens=NEW, ignore_eos=True))
    assert result.cached_tokens >= PROMPT - 8  # the first prompt's full pages, past the window
    assert result.token_ids == _greedy(hf, longer)


def test_under_icecache_local_layers_attend_their_window_and_global_ones_select(windowed):
    hf, path = windowed
    engine = _engine(path)
    args = engine.model.args
    ids, = _prompts(1)
    covering = SelectionConfig(policy="icecache", budget=256, page_size=PAGE, n_unlimited_layers=0)  # all the context
    assert engine.generate(ids, SamplingConfig(max_tokens=NEW, ignore_eos=True), selection=covering).token_ids == \
        _greedy(hf, ids)
    tight = replace(covering, budget=48)  # sink, window and selected pages of 8 tokens
    prefilled = engine.prefill(ids)
    probed = engine.decode(prefilled, SamplingConfig(max_tokens=8, ignore_eos=True), tight, probe=True)
    engine.release(prefilled)
    assert set(probed.layer_stats) == set(args.global_layers)  # only global layers select
    assert probed.new_tokens == 8


def test_a_windowed_model_refuses_compressed_contexts(windowed):
    _, path = windowed
    engine = _engine(path)
    with pytest.raises(ConfigError, match="compressed contexts are not supported for a model with sliding-window"):
        engine.compress(_prompts(1)[0], "kv2", 0.5)
    with pytest.raises(ConfigError, match="sliding-window layers"):
        engine.check_request(10, 8, None, context_tokens=30)


def test_a_pool_off_the_compute_device_reads_only_the_window_too(windowed, monkeypatch):
    """What a GPU runs with the pool in host memory: the compute mirror, each request on its own."""
    from icekv.kv import PagedKVCache

    hf, path = windowed
    engine = _engine(path)
    monkeypatch.setattr(PagedKVCache, "pool_on_compute", property(lambda self: False))
    prompts = _prompts(2)
    assert _run_together(engine, prompts) == [_greedy(hf, ids) for ids in prompts]
