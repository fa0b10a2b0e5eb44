"""The policy plan: a method bound to its settings, resolved once per request."""

from dataclasses import replace

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
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


@pytest.mark.parametrize("policy", ["icecache", "quest", "omnikv", "magicpig", "snapkv"])
def test_no_method_selects_or_indexes_in_a_local_layer(policy):
    plan = resolve(SelectionConfig(policy=policy, n_unlimited_layers=1))
    gemma_like = layers(12, local=(0, 1, 2, 3, 4, 6, 7, 8, 9, 10))  # every sixth layer global
    assert set(plan.sparse_layers(gemma_like)) <= {5, 11} and set(plan.index_layers(gemma_like)) <= {5, 11}
    assert set(plan.sparse_layers(layers(12))) - {5, 11}  # the same method selects elsewhere in a global model


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
