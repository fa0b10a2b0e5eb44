import pytest

from icekv.errors import CacheFullError
from icekv.kv import PageAllocator, PageTable


def test_csr_layout_for_a_batch():
    table = PageTable.build([[4, 1], [], [7, 2, 9]], [20, 0, 33], page_size=16)
    assert table.indptr.tolist() == [0, 2, 2, 5]
    assert table.indices.tolist() == [4, 1, 7, 2, 9]
    assert table.last_page_len.tolist() == [4, 0, 1]
    assert [table.seq_len(i) for i in range(3)] == [20, 0, 33]
    assert table.pages(2).tolist() == [7, 2, 9]
    assert table.batch_size == 3


def test_full_last_page_has_page_size_tokens():
    table = PageTable.build([[0, 1]], [32], page_size=16)
    assert table.last_page_len.tolist() == [16]


def test_page_count_must_match_length():
    with pytest.raises(ValueError):
        PageTable.build([[0]], [17], page_size=16)


def test_allocator_hands_out_distinct_pages_and_refuses_overflow():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    assert not alloc.can_allocate(2)
    with pytest.raises(CacheFullError, match="exhausted"):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4


def test_allocator_continues_a_run_when_it_can():
    alloc = PageAllocator(8)
    a = alloc.allocate(3)  # 0, 1, 2
    b = alloc.allocate(2)  # 3, 4
    assert alloc.allocate(1, after=a[-1]) == [5]  # 3 is taken: the next free page instead
    alloc.free(b)
    assert alloc.allocate(2, after=a[-1]) == [3, 4]  # freed pages right after the run come back to it
    assert alloc.num_free == 2 and sorted(alloc.allocate(2)) == [6, 7]
    with pytest.raises(CacheFullError):
        alloc.allocate(1, after=7)


def test_allocator_free_list_stays_bounded_under_runs_continued_in_place():
    alloc = PageAllocator(6)
    for _ in range(100):  # a request grows page by page in place, then is freed; again and again
        run = alloc.allocate(1)
        for _ in range(4):
            run += alloc.allocate(1, after=run[-1])
        alloc.free(run)
    assert len(alloc._order) <= 2 * 6 and alloc.num_free == 6
    assert sorted(alloc.allocate(6)) == list(range(6))


def test_subset_and_last_tokens_of_a_step_table():
    table = PageTable.build([[4, 1], [], [7, 2, 9]], [20, 0, 33], page_size=16)
    part = table.subset((2, 0))
    assert part.indptr.tolist() == [0, 3, 5] and part.indices.tolist() == [7, 2, 9, 4, 1]
    assert part.lengths.tolist() == [33, 20]
    assert table.subset((2, 0)) is part  # made once per table
    pages, slots = part.last_tokens()  # where each request's last token lies
    assert pages.tolist() == [9, 1] and slots.tolist() == [0, 3]
