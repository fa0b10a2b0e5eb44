"""The device page cache moves only pages it does not already hold, with real bytes."""

import pytest
import torch

from icekv.kv import DevicePageCache
from icekv.methods.selector import Selection


def _plan(dev, selection, versions):
    """Per-head page lists and versions -> the device's transfer plan."""
    picked = Selection.ranked(selection)
    return dev.plan(picked.heads, picked.pages, torch.cat(versions))


def _load(dev, plan, host_k):
    k = host_k[plan.heads, plan.pages]  # [n, P, D]
    dev.load(plan, torch.stack([k, -k]), torch.full((len(plan),), 4))


def test_unchanged_selection_moves_nothing():
    host_k = torch.randn(2, 10, 4, 8)  # [Hkv, pages, P, D]
    dev = DevicePageCache(2, 3, 4, 8)
    sel = [torch.tensor([1, 5, 7]), torch.tensor([0, 2])]
    ver = [torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)]
    plan = _plan(dev, sel, ver)
    assert len(plan) == 5
    _load(dev, plan, host_k)
    moved = dev.bytes_moved
    assert moved == 5 * 2 * 4 * 8 * 4
    again = _plan(dev, sel, ver)
    assert len(again) == 0 and dev.bytes_moved == moved
    # slots hold the right bytes
    for h, pages in enumerate(sel):
        for page in pages.tolist():
            slot = int(torch.nonzero(dev.page[h] == page)[0])
            assert torch.equal(dev.k[h, slot], host_k[h, page]) and torch.equal(dev.v[h, slot], -host_k[h, page])
    assert dev.hits == 5 and dev.lookups == 10


def test_partial_change_reuses_slots_and_stale_versions_reload():
    host_k = torch.randn(1, 10, 4, 8)
    dev = DevicePageCache(1, 3, 4, 8)
    zeros = torch.zeros(3, dtype=torch.long)
    _load(dev, _plan(dev, [torch.tensor([1, 2, 3])], [zeros]), host_k)
    plan = _plan(dev, [torch.tensor([3, 1, 9])], [zeros])
    assert plan.pages.tolist() == [9]
    assert int(plan.slots[0]) == int(torch.nonzero(dev.page[0] == 2)[0])  # evicts the unselected page
    _load(dev, plan, host_k)
    stale = _plan(dev, [torch.tensor([3, 1, 9])], [torch.tensor([0, 1, 0])])  # page 1 changed
    assert stale.pages.tolist() == [1]


def test_attended_lengths_mask_unselected_slots():
    host_k = torch.randn(1, 10, 4, 8)
    dev = DevicePageCache(1, 3, 4, 8)
    _load(dev, _plan(dev, [torch.tensor([1, 2, 3])], [torch.zeros(3, dtype=torch.long)]), host_k)
    _plan(dev, [torch.tensor([2])], [torch.zeros(1, dtype=torch.long)])
    lens = dev.attended_lengths()
    assert lens.sum().item() == 4 and lens[0, int(torch.nonzero(dev.page[0] == 2)[0])].item() == 4


def test_heads_with_empty_or_uneven_selections():
    host_k = torch.randn(3, 10, 4, 8)
    dev = DevicePageCache(3, 4, 4, 8)
    none = torch.zeros(0, dtype=torch.long)
    plan = _plan(dev, [none, torch.tensor([4, 2, 7]), torch.tensor([9])], [none, torch.zeros(3, dtype=torch.long),
                                                                       torch.zeros(1, dtype=torch.long)])
    assert plan.heads.tolist() == [1, 1, 1, 2] and plan.pages.tolist() == [4, 2, 7, 9]
    assert plan.slots.tolist() == [0, 1, 2, 0]  # each head fills its own free slots in order
    _load(dev, plan, host_k)
    assert dev.attended_lengths().sum(1).tolist() == [0, 12, 4]
    assert len(_plan(dev, [none, none, none], [none, none, none])) == 0 and not dev.selected.any()


def test_more_pages_than_slots_is_an_error_not_a_stray_write():
    dev = DevicePageCache(1, 2, 4, 8)
    with pytest.raises(ValueError, match="more pages than it has slots"):
        _plan(dev, [torch.tensor([1, 2, 3])], [torch.zeros(3, dtype=torch.long)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_fill_from_pool_equals_plan_gather_load(dtype, page_size):
    """The fused CPU fill against the staged path, over steps whose selections move, repeat, leave
    heads empty and name pages with holes; slots, their bookkeeping and the counters all equal."""
    from icekv.config.paging import PagingConfig
    from icekv.kv import PagedKVCache

    g = torch.Generator().manual_seed(page_size)
    hkv, d, length, n_pages = 3, 8, 40, 6
    cache = PagedKVCache(1, hkv, d, PagingConfig(page_size=page_size, pool_tokens=64), dtype)
    cache.add(0)
    cache.extend(0, length)
    kv = torch.randn(2, length, hkv, d, generator=g).to(dtype)
    cache.write(0, 0, 0, kv[0], kv[1])
    members = torch.randint(-1, length, (hkv, n_pages, page_size), generator=g)  # each page's tokens, -1: a hole
    fused, staged = DevicePageCache(hkv, 3, page_size, d, dtype), DevicePageCache(hkv, 3, page_size, d, dtype)
    for step in range(8):
        per_head = [torch.randperm(n_pages, generator=g)[: int(torch.randint(0, 4, (1,), generator=g))]
                    for _ in range(hkv)]
        picked = Selection.ranked(per_head)
        versions = picked.pages % 2 * (step // 3)  # odd pages change every few steps
        positions = members[picked.heads, picked.pages]  # [n, P]
        fused.fill_from_pool(picked.heads, picked.pages, versions, positions, cache.pool[0], cache.page_ids(0))
        plan = staged.plan(picked.heads, picked.pages, versions)
        if len(plan):
            rows = members[plan.heads, plan.pages]  # [m, P]
            staged.load(plan, cache.gather_tokens(0, 0, plan.heads, rows), (rows >= 0).sum(-1))
        for name in ("k", "v", "page", "version", "length", "selected"):
            assert torch.equal(getattr(fused, name), getattr(staged, name)), (step, name)
        assert (fused.bytes_moved, fused.hits, fused.lookups) == (staged.bytes_moved, staged.hits, staged.lookups)
    assert fused.bytes_moved > 0 and fused.hits > 0  # both copies and reuse were exercised
