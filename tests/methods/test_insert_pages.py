"""A selector's ``insert`` of many pages in one call leaves the index that a call per page would:
the engine and the vLLM plugin hand over every page that left the window at once."""

import pytest
import torch

from icekv.config.selection import SelectionConfig
from icekv.policies import resolve

POLICIES = ["icecache", "icecache_r", "quest", "arkvale", "magicpig", "pqcache", "streaming", "snapkv", "omnikv"]
HKV, GROUP, D, PAGES = 2, 3, 32, 7
LAYER = 2  # icecache_r: a group leader (its first layers are dense)


def _selector(policy: str, keys: torch.Tensor, region: int):
    """A selector of ``LAYER`` over ``keys`` [Hkv, T, D], indexed up to ``region``."""
    plan = resolve(SelectionConfig(policy=policy, budget=128))
    selector = plan.make_selector()
    if plan.window_queries:
        queries = torch.randn(8, HKV * GROUP, D, generator=torch.Generator().manual_seed(5))  # [W, Hq, D]
        selector.observe_prompt(LAYER, queries, keys)
    selector.build(LAYER, keys[:, :region], 0)
    return plan, selector


def _picks(plan, selector, q: torch.Tensor):
    if hasattr(selector, "sample"):  # MagicPIG samples tokens in place of selecting pages
        samples = selector.sample(LAYER, q, 64)
        return [t.tolist() for t in (samples.positions, samples.norms, samples.mean, samples.kept_share)]
    if hasattr(selector, "observe"):  # OmniKV: its filter layer's query scores the tokens
        selector.observe(LAYER, q)
    selection = selector.select(LAYER, q, plan.selected_pages)
    positions = selector.page_positions(LAYER, selection.heads, selection.pages)
    return [t.tolist() for t in (selection.heads, selection.pages, selection.versions, positions)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("region", [0, 32, 640])  # short: MagicPIG's mean from the first page, PQCache's codebook rebuilt page by page
def test_one_insert_of_many_pages_equals_one_insert_per_page(policy, region):
    g = torch.Generator().manual_seed(0)
    scale = torch.linspace(1.0, 4.0, region + PAGES * 16)[None, :, None]  # norms grow: the max norm moves
    keys = torch.randn(HKV, region + PAGES * 16, D, generator=g) * scale  # [Hkv, T, D]
    plan, by_page = _selector(policy, keys, region)
    _, at_once = _selector(policy, keys, region)
    for start in range(region, keys.shape[1], plan.page_size):
        by_page.insert(LAYER, keys[:, start:start + plan.page_size])
    at_once.insert(LAYER, keys[:, region:])
    for seed in range(3):
        q = torch.randn(HKV * GROUP, D, generator=torch.Generator().manual_seed(10 + seed))  # [Hq, D]
        assert _picks(plan, at_once, q) == _picks(plan, by_page, q)
    assert at_once.index_bytes() == by_page.index_bytes()
