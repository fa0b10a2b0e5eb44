"""The centroids search's rescoring on the device (DeviceRescoring: the candidates' keys cached
there, scored with select_pages) against the host's candidate_search, over the reference and the
Triton kernels (interpreter on CPU, native under ICEKV_TEST_DEVICE=cuda)."""

import os

import numpy as np
import pytest
import torch

from icekv.index import PageStore
from icekv.index.device_centroids import DeviceCentroids
from icekv.index.device_rescoring import DeviceRescoring
from icekv.index.fused_search import candidate_search, union_of_picks
from icekv.index.score_rows import decode
from tests.kernels.conftest import NATIVE, SEARCH_SHAPES, index_layer


def _picks(store, q, candidates, device):
    """Each query head's candidates as the device ranks them [H, G, c]."""
    centroids = DeviceCentroids(store, torch.device(device), torch.float32)
    return centroids.candidates(q.to(device), candidates).cpu().numpy()


@pytest.mark.parametrize("sizes, group, candidates, k", SEARCH_SHAPES)
@pytest.mark.parametrize("score_dtype", [torch.float32, torch.int8])
def test_rescoring_on_the_device_selects_what_the_host_does(backend_device, sizes, group, candidates, k, score_dtype):
    store, trees = index_layer(sizes, dtype=score_dtype)
    rescoring = DeviceRescoring(store, torch.device(backend_device), torch.float32, max_slots=group * candidates)
    # the GQA merge (by score or by head) is host code after the kernels: the reference backend
    # checks both, the (slow, interpreted on a CPU) kernels the default's
    merges = (False, True) if os.environ["ICEKV_KERNELS"] == "torch" else (True,)
    g = torch.Generator().manual_seed(9)
    for step in range(3):  # inserts change pages (new versions), add pages and grow the store
        q = torch.randn(len(sizes), group, 32, generator=g)  # [H, G, D]
        picks = _picks(store, q, candidates, backend_device)
        for by_score in merges:
            host = candidate_search(store, q, picks, k, by_score=by_score)
            on_device = rescoring.search(q.to(backend_device), picks, k, by_score=by_score)
            for a, b in zip(host, on_device):
                assert a.tolist() == b.tolist()
        for tree in trees[:2]:
            tree.insert(torch.randn(16 * (1 + 20 * step), 32, generator=g) * 2)


def test_only_pages_new_to_the_candidates_are_copied(backend_device):
    store, trees = index_layer([900, 600])
    rescoring = DeviceRescoring(store, torch.device(backend_device), torch.float32, max_slots=2 * 12)
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(3))  # [H, G, D]
    picks = _picks(store, q, 12, backend_device)
    cand, n_cand = union_of_picks(picks)
    page_bytes = 16 * 32 * 4
    rescoring.search(q.to(backend_device), picks, 4, by_score=True)
    assert rescoring.bytes_moved == n_cand.sum() * page_bytes and rescoring.hits == 0
    rescoring.search(q.to(backend_device), picks, 4, by_score=True)
    assert rescoring.bytes_moved == n_cand.sum() * page_bytes  # the same candidates: nothing moved
    assert rescoring.hits == n_cand.sum() and rescoring.lookups == 2 * n_cand.sum()

    trees[0].insert(torch.randn(16, 32, generator=torch.Generator().manual_seed(4)) * 2)  # changes some pages
    held = [(h, p) for h in range(2) for p in cand[h, : n_cand[h]]]
    changed = sum(store.version[h, p].item() != rescoring.version[h, rescoring.slot_of[h, p]] for h, p in held)
    moved = rescoring.bytes_moved
    after = rescoring.search(q.to(backend_device), picks, 4, by_score=True)
    assert 0 < changed < len(held)
    assert rescoring.bytes_moved - moved == changed * page_bytes  # exactly the changed candidates reloaded
    assert all(a.tolist() == b.tolist() for a, b in zip(candidate_search(store, q, picks, 4, by_score=True), after))


def test_the_least_recently_used_page_makes_room(backend_device):
    store, _ = index_layer([200])  # one KV head, 13 pages
    rescoring = DeviceRescoring(store, torch.device(backend_device), torch.float32, max_slots=4)
    q = torch.randn(1, 1, 32, device=backend_device)  # [H, G, D]
    resident = lambda: {int(p) for p in rescoring.page[0] if p >= 0}  # noqa: E731
    for picks, hits, held in (([0, 1], 0, {0, 1}), ([2, 3], 0, {0, 1, 2, 3}),  # spare slots keep 0 and 1
                              ([0, 4], 1, {0, 2, 3, 4}),  # 1 was read least recently: 4 replaces it
                              ([2, 3], 2, {0, 2, 3, 4}), ([1, 5], 0, {1, 2, 3, 5})):  # 0 and 4, read before 2 and 3
        before = rescoring.hits
        rescoring.search(q, np.array([[picks]]), 1, by_score=True)
        assert rescoring.hits - before == hits and resident() == held, (picks, resident())


def test_holes_and_pages_without_members(backend_device):
    store, _ = index_layer([64])
    present = torch.ones(2, 16, dtype=torch.bool)
    present[0, 5:] = False  # page 0: 5 members, then holes
    present[1] = False  # page 1: no members
    store.write(0, torch.tensor([0, 1]), torch.randn(2, 16, 32) * 3, present)
    store.version[0, :2] += 1
    q = torch.randn(1, 2, 32)  # [H, G, D]
    picks = np.arange(store.num_pages.item())[None, None].repeat(2, 1)  # every page a candidate
    rescoring = DeviceRescoring(store, torch.device(backend_device), torch.float32, max_slots=2 * picks.shape[-1])
    host = candidate_search(store, q, picks, 3, by_score=True)
    on_device = rescoring.search(q.to(backend_device), picks, 3, by_score=True)
    assert [a.tolist() for a in host] == [b.tolist() for b in on_device]
    assert 1 not in on_device[1].tolist()
    slot = rescoring.slot_of[0, 0]
    holes, first = rescoring.k[0, slot, 5:].cpu(), rescoring.k[0, slot, :1].cpu()  # [11, D], [1, D]
    assert torch.equal(holes, first.expand(11, 32))  # each hole holds a member's key
    assert rescoring.length[0, rescoring.slot_of[0, 1]] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # the compute dtype
@pytest.mark.parametrize("score_dtype", [torch.float32, torch.bfloat16, torch.int8])  # the index's page keys
def test_the_copied_keys_are_the_index_keys_in_the_compute_dtype(monkeypatch, dtype, score_dtype):
    monkeypatch.setenv("ICEKV_KERNELS", "torch")
    store, _ = index_layer([300, 150], dtype=score_dtype)
    rescoring = DeviceRescoring(store, torch.device("cpu"), dtype, max_slots=64)
    picks = np.stack([np.arange(16).reshape(2, 8)] * 2)  # [H, G, c]: 16 pages of each head
    rescoring.search(torch.randn(2, 2, 32), picks, 4, by_score=True)
    for h in range(2):
        for p in range(16):
            keys, member = decode(store.keys[h, p]), store.pad[h, p] == 0  # [P, D], [P]
            first = keys[member][:1] if member.any() else 0.0  # holes: the first member's key (none: 0)
            filled = torch.where(member[:, None], keys, first)  # [P, D]
            assert torch.equal(rescoring.k[h, rescoring.slot_of[h, p]], filled.to(dtype))


def test_nothing_to_rescore(backend_device):
    empty = PageStore(2, 16, 32)
    rescoring = DeviceRescoring(empty, torch.device(backend_device), torch.float32, max_slots=8)
    picks = np.full((2, 3, 4), -1)
    q = torch.randn(2, 3, 32, device=backend_device)
    assert all(len(x) == 0 for x in rescoring.search(q, picks, 4, by_score=True))
    assert rescoring.nbytes == 0


@pytest.mark.skipif(not NATIVE, reason="bf16 tl.dot is wrong in triton's CPU interpreter")
def test_a_bf16_copy_selects_nearly_the_same_pages(kdev):
    store, _ = index_layer([4000, 3000], d=128)
    q = torch.randn(2, 4, 128)
    picks = _picks(store, q, 96, kdev)
    rescoring = DeviceRescoring(store, torch.device(kdev), torch.bfloat16, max_slots=4 * 96)
    host = candidate_search(store, q, picks, 12, by_score=True)
    on_device = rescoring.search(q.to(kdev), picks, 12, by_score=True)
    same = len(set(zip(*host[:2])) & set(zip(*on_device[:2])))
    assert same >= 0.9 * len(host[0])
