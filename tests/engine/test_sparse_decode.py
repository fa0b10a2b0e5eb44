"""Budgeted decoding through the real engine path (selector, device cache, sparse attention)."""

import pytest
import torch

from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine.backends import DenseAttention, RequestPages, SampledAttention, SparseAttention
from icekv.kv import PagedKVCache
from icekv.model import load_model
from icekv.methods.magicpig import MagicPIGConfig
from icekv.methods.omnikv import OmniKVConfig
from icekv.policies import REGISTERED, policy_names, resolve
from tests.conftest import make_tiny_hf_model

POLICIES = [p for p in policy_names() if p != "full"]
# on the 3-layer test models: one filter layer (1), one budgeted layer after it (2)
OWN_SETTINGS = {"omnikv": {"omnikv": OmniKVConfig(filter_layers=(1,), reference_depth=3, wait_layers=0)}}


def selection_for(policy: str, **kwargs) -> SelectionConfig:
    return SelectionConfig(policy=policy, **OWN_SETTINGS.get(policy, {}), **kwargs)


def _decode_logits(model, ids, new_tokens, selection=None):
    a = model.args
    cache = PagedKVCache(a.num_layers, a.num_kv_heads, a.head_dim, PagingConfig(16, 1024))
    cache.add(0)
    backend = DenseAttention(RequestPages(cache, 0))
    plan = resolve(selection or SelectionConfig(policy="full"))
    backend.keep_queries = plan.window_queries_kept(False)
    model(torch.tensor(ids), backend.begin_step(len(ids)), backend)
    if selection is not None:
        kind = SampledAttention if plan.sampled else SparseAttention
        backend = kind(RequestPages(cache, 0), a, plan, plan.make_selector(), window_queries=backend.kept_queries)
    out = []
    for t in new_tokens:
        out.append(model(torch.tensor([t]), backend.begin_step(1), backend)[-1])
        backend.end_step()
    return torch.stack(out), backend


@pytest.mark.parametrize("policy", [p.name for p in REGISTERED if p.name in POLICIES and not p.sampled])
def test_budget_covering_the_context_equals_full_attention(policy, tmp_path):
    make_tiny_hf_model("qwen3", tmp_path)
    model = load_model(tmp_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (300,), generator=g).tolist()
    new = torch.randint(0, 512, (40,), generator=g).tolist()  # 40 steps: window pages flush
    full, _ = _decode_logits(model, ids, new)
    sel = selection_for(policy, budget=1024, n_unlimited_layers=0)
    sparse, backend = _decode_logits(model, ids, new, sel)
    assert len(backend.device) > 0  # some layer attended under the budget
    torch.testing.assert_close(sparse, full, rtol=1e-4, atol=1e-4)
    assert backend.win_start > 300 - 32  # the window moved: flushed pages went into the index


def test_magicpig_sampling_every_token_estimates_full_attention(tmp_path):
    """One-bit tables, 64 of them, one collision enough: every token is sampled with probability
    about 1, so the estimate is full attention; the default tables sample a few and differ."""
    make_tiny_hf_model("qwen3", tmp_path)
    model = load_model(tmp_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (300,), generator=g).tolist()
    new = torch.randint(0, 512, (40,), generator=g).tolist()
    full, _ = _decode_logits(model, ids, new)
    every = MagicPIGConfig(bits=1, tables=64, min_collisions=1)
    sampled, backend = _decode_logits(model, ids, new, selection_for("magicpig", budget=1024, magicpig=every))
    torch.testing.assert_close(sampled, full, rtol=1e-3, atol=1e-3)
    assert backend.selector.sampled[2] > 0.95 * (300 - 64)  # (nearly) every indexed token, every step
    few, backend = _decode_logits(model, ids, new, selection_for("magicpig", budget=1024))
    assert not torch.allclose(few, full, atol=1e-3)
    assert backend.selector.sampled[3] < 300 - 64


@pytest.mark.parametrize("policy", POLICIES)
def test_small_budget_differs_but_stays_bounded(policy, tmp_path):
    make_tiny_hf_model("llama", tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    sel = selection_for(policy, budget=64, n_unlimited_layers=1)
    _, backend = _decode_logits(model, ids, [5, 6, 7], sel)
    per_layer_token = backend.cache.bytes_per_token // backend.cache.num_layers
    dense = model.args.num_layers - len(backend.sparse_layers)
    # device residency: the dense layers whole, each budgeted one its budget, what the selector keeps there
    bound = (dense * 403 + len(backend.sparse_layers) * 64) * per_layer_token + backend.selector.device_bytes()
    assert backend.resident_bytes() <= bound < 403 * backend.cache.bytes_per_token
    for dev in backend.device.values():
        assert int(dev.attended_lengths().sum()) <= 2 * 16 * model.args.num_kv_heads


@pytest.mark.parametrize("policy", POLICIES)
def test_prompts_shorter_than_sink_and_window_decode(policy, tmp_path):
    make_tiny_hf_model("llama", tmp_path)
    model = load_model(tmp_path)
    full, _ = _decode_logits(model, [1, 2, 3, 4, 5], list(range(50)))
    sel = selection_for(policy, budget=128, n_unlimited_layers=0)
    sparse, backend = _decode_logits(model, [1, 2, 3, 4, 5], list(range(50)), sel)
    torch.testing.assert_close(sparse, full, rtol=1e-4, atol=1e-4)  # 55 tokens < budget: all attended


def test_centroids_scored_on_the_compute_device_select_what_the_host_does(tmp_path):
    """The GPU's searches (centroids scored where the query is, candidates rescored on the host or
    there too), run on the CPU: the same pages every step, through inserts, so the same logits."""
    make_tiny_hf_model("llama", tmp_path)
    model = load_model(tmp_path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (600,), generator=g).tolist()
    new = torch.randint(0, 512, (40,), generator=g).tolist()  # window pages flush into the index
    runs = {}
    for where in (("host", "host"), ("device", "host"), ("device", "device")):
        sel = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=1,
                              icecache=IceCacheConfig(search="centroids", centroid_scoring=where[0],
                                                      rescoring=where[1]))
        runs[where] = _decode_logits(model, ids, new, sel)
    host, on_host = runs["host", "host"]
    for where in (("device", "host"), ("device", "device")):
        device, on_device = runs[where]
        torch.testing.assert_close(device, host, rtol=0, atol=0)
        assert on_device.resident_bytes() == on_host.resident_bytes() + on_device.selector.device_bytes()
        assert set(on_device.selector.device_centroids) == set(on_device.sparse_layers)
    assert on_host.selector.device_bytes() == 0
    ranked, rescored = runs["device", "host"][1].selector, runs["device", "device"][1].selector
    assert not ranked.device_rescoring
    assert set(rescored.device_rescoring) == set(runs["device", "device"][1].sparse_layers)
    assert rescored.device_bytes() > ranked.device_bytes()  # + the candidates' keys
    cache = next(iter(rescored.device_rescoring.values()))
    assert cache.hits > 0 and cache.bytes_moved > 0  # the candidates' keys came over once, then were reused
    moved = {where: backend.kv_stats().index_bytes_moved for where, (_, backend) in runs.items()}
    assert moved["host", "host"] == 0 < moved["device", "host"] < moved["device", "device"]
    assert moved["device", "device"] == rescored.bytes_to_device()


@pytest.mark.model
def test_real_model_request_within_its_budget_attends_every_token(engine):
    """260 + 20 tokens under a 512-token budget: nothing to select, no index, full attention's
    tokens; under a 64-token budget the same request selects pages."""
    ids = engine.tokenizer.encode("The history of the city begins " * 40)[:260]
    sampling = SamplingConfig(max_tokens=20, ignore_eos=True)
    req = engine.prefill(ids)
    try:
        full = engine.decode(req, sampling)
        for policy in ("quest", "icecache"):
            within = engine.decode(req, sampling, SelectionConfig(policy=policy, budget=512))
            assert within.token_ids == full.token_ids and within.policy == policy
            assert within.kv.bytes_moved == 0 and within.kv.index_bytes == 0
            assert within.kv.resident_bytes == within.kv.total_bytes
            beyond = engine.decode(req, sampling, SelectionConfig(policy=policy, budget=64))
            assert beyond.kv.bytes_moved > 0 and beyond.kv.index_bytes > 0
            assert beyond.kv.resident_bytes < beyond.kv.total_bytes
    finally:
        engine.release(req)
