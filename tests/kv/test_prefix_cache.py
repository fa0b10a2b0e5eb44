"""The prefix cache's bookkeeping, and the pool that shares its pages."""

import pytest
import torch

from icekv.config.paging import PagingConfig
from icekv.errors import CacheFullError
from icekv.kv import PagedKVCache, PrefixCache
from icekv.kv.prefix_cache import page_keys

P = 4


def test_a_key_names_the_whole_prefix_and_the_model():
    a = page_keys("m", [1, 2, 3, 4, 5, 6, 7, 8, 9], P)
    assert len(a) == 2  # the partial third page has no key
    assert page_keys("m", [9, 2, 3, 4, 5, 6, 7, 8], P)[1] != a[1]  # same second page, other first page
    assert page_keys("other", [1, 2, 3, 4], P)[0] != a[0]


def test_match_takes_the_longest_cached_chain_within_the_limit_and_holds_it():
    cache = PrefixCache("m", P)
    ids = list(range(12))
    assert cache.insert(ids + [99], [7, 3, 5, 8]) == [8]  # the partial page is not kept
    assert cache.pages == 3 and cache.evictable == 3
    assert cache.match(ids[:8] + [0, 0, 0, 0, 1], 100) == [7, 3]  # diverges in the third page
    assert cache.evictable == 1  # the held two cannot go
    assert cache.match(ids + [1], 9) == [7, 3]  # the limit: at most 9 tokens -> 2 pages
    assert cache.stats.hit_tokens == 16 and cache.stats.miss_tokens == 5 + 5
    cache.release([7, 3])
    assert cache.evictable == 1
    cache.release([7, 3])
    assert cache.evictable == 3


def test_idle_pages_go_least_recently_used_first_and_a_chain_tail_before_its_head():
    cache = PrefixCache("m", P)
    cache.insert(list(range(8)), [1, 2])
    cache.insert(list(range(100, 108)), [3, 4])
    assert cache.evict(1) == [2]  # the older chain's tail
    cache.release(cache.match(list(range(8)) + [0], 100))  # chain 1 (now one page) used again
    assert cache.evict(2) == [4, 3]  # chain 2, tail first
    assert cache.evict(5) == [1] and cache.stats.evictions == 4
    assert cache.match(list(range(8)) + [0], 100) == []


def test_a_prefix_cached_twice_keeps_the_first_copy():
    cache = PrefixCache("m", P)
    assert cache.insert(list(range(8)), [1, 2]) == []
    held = cache.match(list(range(4)) + [50, 51, 52, 53, 54], 100)  # the first page
    assert held == [1]
    # that request cached its own second page: pages[:1] were its hit
    assert cache.insert(list(range(4)) + [50, 51, 52, 53], [1, 9], first=1) == []
    assert sorted(cache.insert(list(range(8)), [5, 6])) == [5, 6]  # both duplicates
    cache.release(held)
    assert cache.pages == 3


def test_retained_pages_go_only_when_no_other_idle_page_is_left():
    now = [0.0]
    cache = PrefixCache("m", P, clock=lambda: now[0])
    cache.insert(list(range(8)), [1, 2], retention_s=10)
    cache.insert(list(range(100, 108)), [3, 4])  # newer, not retained
    assert cache.evict(2) == [4, 3]  # the unretained chain first, though more recently used
    assert cache.stats.retained_evictions == 0
    assert cache.evict(1) == [2] and cache.stats.retained_evictions == 1  # pressure wins, counted
    now[0] = 11.0  # retention over: plain LRU again
    cache.insert(list(range(200, 204)), [5])
    assert cache.evict(2) == [1, 5] and cache.stats.retained_evictions == 1


def test_a_hit_released_with_retention_extends_it():
    now = [0.0]
    cache = PrefixCache("m", P, clock=lambda: now[0])
    cache.insert(list(range(4)), [1])
    cache.insert(list(range(50, 54)), [2])
    cache.release(cache.match(list(range(4)) + [9], 100), retention_s=5)
    assert cache.evict(1) == [2]
    now[0] = 6.0
    cache.insert(list(range(60, 64)), [3])
    assert cache.evict(1) == [1]  # its retention has ended: least recently used goes


def _pool(num_pages: int) -> PagedKVCache:
    paging = PagingConfig(page_size=P, pool_tokens=num_pages * P)
    return PagedKVCache(1, 1, 2, paging, prefix=PrefixCache("m", P))


def _fill(pool: PagedKVCache, seq_id: int, ids: list[int], most_cached: int) -> int:
    """A request over ``ids``: its hit, then its own tokens written (K = the token id)."""
    hit = pool.add(seq_id, ids, most_cached)
    start = pool.extend(seq_id, len(ids) - hit)
    k = torch.tensor(ids[hit:], dtype=torch.float32)[:, None, None].expand(-1, 1, 2)  # [T, 1, 2]
    pool.write(0, seq_id, start, k, k)
    return hit


def test_a_hit_reads_the_cached_tokens_and_writes_only_its_own_pages():
    pool = _pool(8)
    first = list(range(10, 22))  # 3 pages
    assert _fill(pool, 0, first, 0) == 0
    pool.free(0, cache_tokens=first)
    assert pool.allocator.num_free == 5 and pool.pages_available == 8
    second = first[:8] + [70, 71, 72]
    assert _fill(pool, 1, second, len(second) - 1) == 8
    keys, _ = pool.gather(0, 1)  # [1, 11, 2]
    assert keys[0, :, 0].tolist() == second
    assert pool.page_ids(1)[:2].tolist() == pool.prefix.match(first, 8)  # the cached pages themselves
    pool.prefix.release(pool.page_ids(1)[:2].tolist())
    third = first + [5]  # the whole first prompt, still cached
    assert _fill(pool, 2, third, len(third) - 1) == 12
    assert pool.gather(0, 2)[0][0, :, 0].tolist() == third
    pool.free(1)
    pool.free(2)
    assert pool.pages_available == 8


def test_an_allocation_evicts_idle_pages_but_never_held_ones():
    pool = _pool(5)
    ids = list(range(8))
    _fill(pool, 0, ids, 0)
    pool.free(0, cache_tokens=ids)
    assert _fill(pool, 1, ids + [9], 8) == 8  # holds both cached pages, and one of its own
    assert pool.pages_available == 2
    _fill(pool, 2, list(range(50, 58)), 0)  # two pages: the last free ones
    with pytest.raises(CacheFullError):
        pool.extend(2, 1)  # nothing idle to evict: the held pages stay
    pool.free(2, cache_tokens=list(range(50, 58)))
    assert pool.pages_available == 2
    pool.extend(1, 8)  # needs 2 pages: both of request 2's cached ones are evicted
    assert pool.prefix.stats.evictions == 2
    assert pool.gather(0, 1)[0][0, :9, 0].tolist() == ids + [9]


def test_truncating_into_the_cached_prefix_lets_go_of_those_pages():
    pool = _pool(6)
    ids = list(range(12))
    _fill(pool, 0, ids, 0)
    pool.free(0, cache_tokens=ids)
    _fill(pool, 1, ids + [1], 12)
    pool.truncate(1, 5)  # keeps page 0 whole and page 1 in part (as a copy): cached pages 1 and 2 let go, not freed
    assert pool.prefix.evictable == 2 and pool.pages_held(1) == 2
    pool.free(1)
    assert pool.prefix.evictable == 3 and pool.pages_available == 6


def test_a_request_freed_with_retention_keeps_its_pages_past_newer_idle_ones():
    pool = _pool(5)
    kept, other = list(range(8)), list(range(50, 58))
    _fill(pool, 0, kept, 0)
    pool.free(0, cache_tokens=kept, retention_s=1000)
    _fill(pool, 1, other, 0)
    pool.free(1, cache_tokens=other)
    _fill(pool, 2, list(range(90, 102)), 0)  # 3 pages: 1 free, then the unretained request's two
    assert pool.prefix.stats.evictions == 2 and pool.prefix.stats.retained_evictions == 0
    assert len(pool.prefix.match(kept + [1], 8)) == 2  # the retained prefix is still there


def test_a_running_requests_published_pages_are_shared_then_cached_when_it_ends():
    pool = _pool(8)
    ids = list(range(10))  # 2 full pages and a partial one
    _fill(pool, 0, ids, 0)
    pool.publish(0, ids)
    assert pool.prefix.pages == 2 and pool.prefix.evictable == 0  # held by request 0
    assert _fill(pool, 1, ids + [7, 7], 11) == 8  # a request starting now shares them
    pool.extend(0, 3)  # request 0 goes on writing its own partial page
    pool.write(0, 0, 10, torch.full((3, 1, 2), 5.0), torch.full((3, 1, 2), 5.0))
    assert pool.gather(0, 1)[0][0, :, 0].tolist() == ids + [7, 7]
    pool.free(0, cache_tokens=ids + [5, 5, 5])
    assert pool.prefix.pages == 3 and pool.prefix.evictable == 1  # its third page now; the two still held
    pool.free(1)
    assert pool.prefix.evictable == 3 and pool.pages_available == 8


def test_publishing_stops_at_a_prefix_another_request_cached_first():
    pool = _pool(8)
    ids = list(range(8))
    _fill(pool, 0, ids, 0)
    _fill(pool, 1, ids, 0)  # the same prompt, prefilled beside it
    pool.publish(0, ids)
    pool.publish(1, ids)
    assert pool.prefix.pages == 2
    pool.free(1, cache_tokens=ids)  # its copies are duplicates: freed
    pool.free(0, cache_tokens=ids)
    assert pool.prefix.pages == 2 and pool.allocator.num_free == 6


def test_a_finished_conversation_is_evicted_from_its_last_page_back():
    pool = _pool(8)
    ids = list(range(8))  # a 2-page prompt ...
    _fill(pool, 0, ids, 0)
    pool.publish(0, ids)
    answer = list(range(40, 48))  # ... and 2 pages of answer
    pool.extend(0, 8)
    pool.write(0, 0, 8, torch.full((8, 1, 2), 1.0), torch.full((8, 1, 2), 1.0))
    prompt_pages, answer_pages = pool.page_ids(0)[:2].tolist(), pool.page_ids(0)[2:].tolist()
    pool.free(0, cache_tokens=ids + answer)
    assert pool.prefix.evict(1) == [answer_pages[-1]]  # the tail goes first ...
    assert pool.prefix.match(ids + answer + [0], 100) == prompt_pages + answer_pages[:1]  # ... the rest still hits
    pool.prefix.release(prompt_pages + answer_pages[:1])


def test_truncating_inside_a_cached_page_copies_it_before_it_is_written():
    pool = _pool(8)
    ids = list(range(12))
    _fill(pool, 0, ids, 0)
    pool.free(0, cache_tokens=ids)
    _fill(pool, 1, ids + [1], 12)  # holds the 3 cached pages
    cached = pool.page_ids(1)[:3].tolist()
    pool.truncate(1, 6)  # keeps page 0 whole and page 1 in part
    assert pool.page_ids(1)[0] == cached[0] and pool.page_ids(1)[1] != cached[1]  # page 1 is a copy
    pool.extend(1, 1)
    pool.write(0, 1, 6, torch.full((1, 1, 2), -1.0), torch.full((1, 1, 2), -1.0))
    assert pool.gather(0, 1)[0][0, :, 0].tolist() == ids[:6] + [-1]
    pool.free(1)
    again = pool.prefix.match(ids + [1], 12)
    assert again == cached  # the cached pages were never written
    pool.prefix.release(again)
