"""The plugin's index over vLLM's cache layout, checked without vLLM: rows read back through a
shuffled block table, and decode attention against plain torch over the tokens it must attend."""

import numpy as np
import pytest
import torch

from icekv.config.selection import SelectionConfig
from icekv.policies import resolve
from icekv.policies.index_cache import KeptIndex
from icekv.kernels.cpu_decode import block_rows_decode_cpu
from icekv.vllm.request_index import BlockLayout, BlockRows, RequestIndex, attend_reference

HKV, GROUP, D, BLOCK = 2, 3, 16, 32
LAYOUT = BlockLayout.plain(BLOCK, D)


def _cache(length: int, seed: int = 0):
    """Dense K and V [Hkv, length, D] and the same rows in a vLLM CPU cache under a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(HKV, length, D, generator=g), torch.randn(HKV, length, D, generator=g)
    blocks = -(-length // BLOCK)
    table = torch.randperm(blocks + 3, generator=g)[:blocks].int()  # [blocks]: unused blocks in between
    cache = torch.full((blocks + 3, HKV, BLOCK, 2 * D), float("nan"))  # [nb, Hkv, bs, 2D]
    tiles = cache.view(blocks + 3, HKV, 2 * BLOCK, D)  # per block and head: its K rows, then its V rows
    for t in range(length):
        tiles[table[t // BLOCK], :, t % BLOCK] = keys[:, t]
        tiles[table[t // BLOCK], :, BLOCK + t % BLOCK] = values[:, t]
    return keys, values, cache, table


def _reference(q, keys, values, positions, scale):
    """q [Hq, D] over each KV head's ``positions`` (a list of [n_h]) of dense K/V."""
    out = []
    for h in range(HKV):
        k, v = keys[h, positions[h]], values[h, positions[h]]  # [n, D]
        p = (q[h * GROUP:(h + 1) * GROUP] @ k.T * scale).softmax(-1)  # [G, n]
        out.append(p @ v)
    return torch.cat(out)


@pytest.mark.parametrize("length", [1, 31, 32, 100])
def test_rows_come_back_through_the_block_table(length):
    keys, values, cache, table = _cache(length)
    rows = BlockRows(cache, table, LAYOUT)
    positions = torch.randint(0, length, (HKV, 7))
    k, v = rows.gather(positions)
    assert torch.equal(k, torch.stack([keys[h, positions[h]] for h in range(HKV)]))
    assert torch.equal(v, torch.stack([values[h, positions[h]] for h in range(HKV)]))
    assert torch.equal(rows.key_range(0, length), keys)


@pytest.mark.parametrize("start, end", [(0, 1), (5, 6), (31, 33), (32, 64), (3, 97), (64, 100), (32, 32), (7, 7)])
def test_key_ranges_equal_the_rows_gathered_one_by_one(start, end):
    """Ranges starting and ending inside blocks, under a layout that is not the plain one (keys
    dim-major in the tile, as vLLM packs fp32 for its vector kernel)."""
    keys, values, plain_cache, table = _cache(100)
    dim_major = BlockLayout(torch.arange(BLOCK * D).view(D, BLOCK).T, LAYOUT.values)  # [bs, D]: K[t, j] at j * bs + t
    cache = plain_cache.clone()
    tiles = cache.view(cache.shape[0], HKV, -1)  # [nb, Hkv, 2 * bs * D]
    plain_tiles = plain_cache.view(cache.shape[0], HKV, -1)
    tiles[:, :, dim_major.keys.flatten()] = plain_tiles[:, :, LAYOUT.keys.flatten()]
    for layout, c in ((LAYOUT, plain_cache), (dim_major, cache)):
        rows = BlockRows(c, table, layout)
        positions = torch.arange(start, end).expand(HKV, -1)
        assert torch.equal(rows.key_range(start, end), rows.gather(positions)[0])
        assert torch.equal(rows.key_range(start, end), keys[:, start:end])


def test_a_budget_that_covers_every_page_attends_every_token_as_decoding_moves_the_window():
    keys, values, cache, table = _cache(360)
    index = RequestIndex(resolve(SelectionConfig(policy="quest", budget=384)))  # 20 pages: every page
    g = torch.Generator().manual_seed(1)
    for length in range(300, 361, 7):  # the window crosses pages: they join the index
        q = torch.randn(HKV * GROUP, D, generator=g)
        out = index.attend(5, q, BlockRows(cache, table, LAYOUT), length, D**-0.5)
        every = [torch.arange(length)] * HKV
        torch.testing.assert_close(out, _reference(q, keys, values, every, D**-0.5), rtol=1e-5, atol=1e-5)
    assert index.window_start[5] == index.plan.window_start(index.plan.sink_tokens, 358)


def test_a_small_budget_attends_sink_newest_pages_and_window():
    keys, values, cache, table = _cache(500)
    plan = resolve(SelectionConfig(policy="streaming", budget=128))  # sink 2 pages, window 2, 4 selected
    index = RequestIndex(plan)
    q = torch.randn(HKV * GROUP, D, generator=torch.Generator().manual_seed(2))
    out = index.attend(0, q, BlockRows(cache, table, LAYOUT), 500, 0.25)
    window = plan.window_start(plan.sink_tokens, 500)
    attended = torch.cat([torch.arange(plan.sink_tokens), torch.arange(window - 4 * 16, 500)])
    torch.testing.assert_close(out, _reference(q, keys, values, [attended] * HKV, 0.25), rtol=1e-5, atol=1e-5)


def test_icecache_selects_per_kv_head_within_its_budget():
    keys, values, cache, table = _cache(800)
    index = RequestIndex(resolve(SelectionConfig(policy="icecache", budget=128)))
    q = torch.randn(HKV * GROUP, D, generator=torch.Generator().manual_seed(3))
    out = index.attend(3, q, BlockRows(cache, table, LAYOUT), 800, D**-0.5)
    assert out.shape == q.shape and torch.isfinite(out).all() and index.steps == 1
    selection = index.selector.select(3, q, index.plan.selected_pages)
    picked = index.selector.page_positions(3, selection.heads, selection.pages)
    sink, window = index.plan.sink_tokens, index.window_start[3]
    attended = [torch.cat([torch.arange(sink), picked[selection.heads == h].flatten(), torch.arange(window, 800)])
                for h in range(HKV)]
    attended = [p[p >= 0] for p in attended]
    assert all(len(p) <= index.plan.budget for p in attended)
    torch.testing.assert_close(out, _reference(q, keys, values, attended, D**-0.5), rtol=1e-5, atol=1e-5)


def test_a_continued_index_attends_as_the_request_that_kept_decoding_would():
    """A request's index, released after its window moved, continued by a request whose tokens
    start with its own: the next request attends what one request decoding on over the same rows
    attends (the index's pages, their positions and the window's start carried over)."""
    keys, values, cache, table = _cache(900)
    plan, layers, g = resolve(SelectionConfig(policy="icecache", budget=128)), (2, 3), torch.Generator().manual_seed(4)
    queries = [torch.randn(HKV * GROUP, D, generator=g) for _ in range(3)]
    one, released = RequestIndex(plan), RequestIndex(plan)
    for index in (one, released):
        for length, q in zip((700, 760), queries):  # built at 700; pages join as the window moves
            for layer in layers:
                index.attend(layer, q, BlockRows(cache, table, LAYOUT), length, D**-0.5)
    covered = released.covered(len(layers))
    assert covered == plan.window_start(plan.sink_tokens, 760) and released.covered(len(layers) + 1) is None
    continued = RequestIndex(plan, KeptIndex(released.selector, covered, released.selector.index_bytes()))
    assert continued.covered(len(layers)) == covered  # taken over, released before it attends: still kept
    moved = torch.randperm(cache.shape[0], generator=g)  # the next request's blocks: the same rows elsewhere
    moved_cache = torch.empty_like(cache)
    moved_cache[moved] = cache
    for layer in layers:
        expected = one.attend(layer, queries[2], BlockRows(cache, table, LAYOUT), 900, D**-0.5)
        got = continued.attend(layer, queries[2], BlockRows(moved_cache, moved[table.long()].int(), LAYOUT), 900,
                               D**-0.5)
        assert torch.equal(got, expected) and continued.window_start[layer] == one.window_start[layer]
    assert continued.window_start[2] > covered  # the pages past the kept region were inserted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, head_dim, block, dim_major", [
    (1, 1, 16, 32, False), (2, 7, 64, 32, True), (3, 3, 80, 64, False), (8, 4, 128, 128, True), (2, 1, 8, 16, True)])
def test_the_compiled_decode_over_vllms_blocks_matches_plain_torch(dtype, kv_heads, group, head_dim, block, dim_major):
    """Odd head dims and groups, one KV head or many, a dim-major key layout, pages with empty
    slots, a head with no picked page, an empty sink range, bf16 read as its words."""
    g = torch.Generator().manual_seed(kv_heads * head_dim + block)
    blocks, page = 12, 16
    cache = torch.randn(blocks + 2, kv_heads, block, 2 * head_dim, generator=g).to(dtype)  # [nb, Hkv, bs, 2D]
    table = torch.randperm(blocks + 2, generator=g)[:blocks].int()  # [blocks]
    cache[[b for b in range(blocks + 2) if b not in table.tolist()]] = float("nan")  # not the request's: never read
    plain = BlockLayout.plain(block, head_dim)
    layout = BlockLayout(torch.arange(block * head_dim).view(head_dim, block).T, plain.values) if dim_major else plain
    rows = BlockRows(cache, table, layout)
    length = blocks * block
    heads = torch.tensor([h for h in range(kv_heads) if h != 1 for _ in range(3)])  # [n]: KV head 1 picks none
    pages = torch.randperm(length // page - 3, generator=g)[: len(heads)]  # [n]
    picked = pages[:, None] * page + torch.arange(page)  # [n, P]
    picked[:, page - 5:] = -1  # empty slots
    q = torch.randn(kv_heads * group, head_dim, generator=g).to(dtype)
    for ranges in ([[0, 16], [length - 40, length]], [[0, 0], [length - 1, length]]):
        ranges = np.array(ranges, dtype=np.int64)  # [2, 2] sink, window
        want = attend_reference(q, rows, ranges, heads, picked, head_dim**-0.5)
        got = block_rows_decode_cpu(q, rows.tiles, rows.block_table, layout.keys, layout.values, ranges, heads, picked,
                                    head_dim**-0.5)
        assert got.dtype == dtype and got.shape == q.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_the_compiled_decode_refuses_a_position_past_the_requests_blocks():
    cache = torch.randn(3, HKV, BLOCK, 2 * D)  # [nb, Hkv, bs, 2D]
    rows = BlockRows(cache, torch.tensor([2, 0], dtype=torch.int32), LAYOUT)  # 64 tokens
    q = torch.randn(HKV * GROUP, D)
    picked = torch.arange(16)[None, :] + 48  # [1, P]: the request's last page
    ranges = np.array([[0, 16], [60, 64]], dtype=np.int64)
    out = block_rows_decode_cpu(q, rows.tiles, rows.block_table, LAYOUT.keys, LAYOUT.values, ranges,
                                torch.tensor([1]), picked, 0.25)
    torch.testing.assert_close(out, attend_reference(q, rows, ranges, torch.tensor([1]), picked, 0.25))
    for ranges, picked in ((np.array([[0, 16], [60, 65]]), picked), (ranges, picked + 1)):
        with pytest.raises(IndexError, match="past the request's 64 tokens"):
            block_rows_decode_cpu(q, rows.tiles, rows.block_table, LAYOUT.keys, LAYOUT.values, ranges,
                                  torch.tensor([1]), picked, 0.25)
