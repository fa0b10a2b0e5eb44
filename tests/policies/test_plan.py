"""The policy plan: a method bound to its settings, resolved once per request."""

from dataclasses import replace

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError
from icekv.methods.snapkv import SnapKVConfig
from icekv.model.random import shape_args
from icekv.policies import resolve


def layers(n: int, local: tuple[int, ...] = ()):
    """A model's args with ``n`` layers, ``local`` of them attending a window of 64 tokens."""
    return replace(shape_args("llama-tiny"), num_layers=n, sliding_window=64 if local else None, local_layers=local)


def test_the_plan_derives_the_region_from_the_budget_unless_given():
    small, wide = resolve(SelectionConfig(budget=64)), resolve(SelectionConfig(budget=512))
    assert (small.sink_pages, small.window_pages, small.selected_pages) == (1, 1, 2)
    assert (wide.sink_pages, wide.window_pages, wide.selected_pages) == (2, 2, 28)
    given = resolve(SelectionConfig(budget=512, n_sink_pages=0, n_win_pages=3))
    assert (given.sink_tokens, given.window_tokens, given.selected_pages) == (0, 64, 29)
    assert wide.window_start(wide.sink_tokens, 1000) == (999 // 16 - 1) * 16  # the newest token's page and one more
    assert wide.window_start(wide.sink_tokens, 40) == wide.sink_tokens  # never before the sink's end


def test_a_plan_is_a_value_equal_to_another_resolve_of_the_same_selection():
    selection = SelectionConfig(policy="snapkv", budget=128, snapkv=SnapKVConfig(window=8))
    assert resolve(selection) == resolve(selection) and hash(resolve(selection)) == hash(resolve(selection))
    assert resolve(selection) != resolve(replace(selection, budget=256))
    assert resolve(selection).window_queries == 8 and resolve(SelectionConfig()).window_queries == 0
    assert resolve(SelectionConfig()).window_queries_kept(for_later_decodes=True) == SnapKVConfig.window


def test_the_budget_only_binds_the_layers_the_method_budgets():
    full, ice = resolve(SelectionConfig(policy="full")), resolve(SelectionConfig(n_unlimited_layers=3))
    assert list(full.sparse_layers(layers(30))) == [] and not full.selects(10**6) and full.make_selector() is None
    assert list(ice.sparse_layers(layers(30))) == list(range(3, 30))
    assert ice.index_layers(layers(30)) == ice.sparse_layers(layers(30))
    assert not ice.selects(ice.budget) and ice.selects(ice.budget + 1)  # within its budget it attends every token
    omnikv = resolve(SelectionConfig(policy="omnikv"))
    assert set(omnikv.index_layers(layers(32))) - set(omnikv.sparse_layers(layers(32)))  # filter layers: dense, indexed


GEMMA_LIKE = layers(62, local=tuple(i for i in range(62) if (i + 1) % 6))  # Gemma 3 27B: every sixth layer global


@pytest.mark.parametrize("policy", ["icecache", "quest", "omnikv", "magicpig", "snapkv", "pqcache", "arkvale"])
def test_a_method_sees_a_model_with_local_layers_as_its_global_layers(policy):
    """The same layers by rank: the method's rule over the 10 global layers of the hybrid model
    picks what it picks in a 10-layer model, mapped onto those global layers."""
    plan = resolve(SelectionConfig(policy=policy))
    hybrid, dense = GEMMA_LIKE, layers(10)
    global_layers = hybrid.global_layers
    assert global_layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    assert plan.sparse_layers(hybrid) == tuple(global_layers[i] for i in plan.sparse_layers(dense))
    assert plan.index_layers(hybrid) == tuple(global_layers[i] for i in plan.index_layers(dense))
    assert plan.sparse_layers(hybrid)  # each method still budgets some of them


def test_omnikvs_filters_run_before_every_layer_they_choose_for():
    plan = resolve(SelectionConfig(policy="omnikv"))
    filters = set(plan.index_layers(GEMMA_LIKE)) - set(plan.sparse_layers(GEMMA_LIKE))
    assert filters and min(filters) < min(plan.sparse_layers(GEMMA_LIKE))
    assert all(GEMMA_LIKE.window(layer) is None for layer in filters)


def test_a_method_sharing_state_across_consecutive_layers_is_refused_on_a_hybrid_model():
    plan = resolve(SelectionConfig(policy="icecache_r"))
    plan.check_model(layers(12))
    with pytest.raises(ConfigError, match="'icecache_r' shares its index across consecutive layers"):
        plan.check_model(GEMMA_LIKE)
    resolve(SelectionConfig(policy="icecache")).check_model(GEMMA_LIKE)


@pytest.mark.model
def test_the_engine_looks_each_request_s_method_up_once(engine, monkeypatch):
    import icekv.engine.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "resolve", lambda selection: calls.append(selection) or resolve(selection))
    sampling = SamplingConfig(max_tokens=2)
    engine.generate("The capital of France is", sampling)  # the engine's own plan, resolved at its start
    assert calls == []
    selection = SelectionConfig(policy="quest", budget=64)
    engine.generate("The capital of France is", sampling, selection=selection)
    assert calls == [selection]
    plan = resolve(SelectionConfig(policy="streaming", budget=64))
    assert engine.generate("The capital of France is", sampling, selection=plan).policy == "streaming"
    assert calls == [selection]  # a resolved plan is taken as it is
