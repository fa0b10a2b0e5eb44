"""The centroids search with the centroids scored where the query is (DeviceCentroids through
select_pages, then candidate_search on the host) against the host's compiled search, over the
reference and the Triton kernels (interpreter on CPU, native under ICEKV_TEST_DEVICE=cuda)."""

import numpy as np
import pytest
import torch

from icekv.index import PageStore
from icekv.index.device_centroids import DeviceCentroids
from icekv.index.fused_search import candidate_search, centroid_search
from icekv.index.score_rows import decode
from tests.kernels.conftest import NATIVE, SEARCH_SHAPES, index_layer


def _both(store, centroids, q, candidates, k):
    host = centroid_search(store, q, candidates, k, by_score=True)
    picks = centroids.candidates(q.to(centroids.device), candidates)  # [H, G, c]
    assert picks.device == centroids.device and picks.shape[:2] == q.shape[:2]
    return host, candidate_search(store, q, picks.cpu().numpy(), k, by_score=True)


@pytest.mark.parametrize("sizes, group, candidates, k", SEARCH_SHAPES)
@pytest.mark.parametrize("score_dtype", [torch.float32, torch.int8])
def test_scoring_the_centroids_on_the_device_selects_what_the_host_does(backend_device, sizes, group, candidates, k,
                                                                        score_dtype):
    store, trees = index_layer(sizes, dtype=score_dtype)
    centroids = DeviceCentroids(store, torch.device(backend_device), torch.float32)
    g = torch.Generator().manual_seed(9)
    for step in range(3):  # inserts change pages, add pages and grow the store: refresh follows
        q = torch.randn(len(sizes), group, 32, generator=g)  # [H, G, D]
        host, device_scored = _both(store, centroids, q, candidates, k)
        for a, b in zip(host, device_scored):
            assert a.tolist() == b.tolist()
        for tree in trees[:2]:
            tree.insert(torch.randn(16 * (1 + 20 * step), 32, generator=g) * 2)
        centroids.refresh()
        live = (store.tokens >= 0).any(-1)  # [H, cap]
        assert centroids.live.cpu().bool().tolist() == live.tolist()
        assert torch.equal(centroids.centroid[:, :, 0].cpu()[live], decode(store.centroid)[live])


def test_a_page_without_members_is_never_a_candidate(backend_device):
    store, _ = index_layer([64])
    store.write(0, torch.tensor([0]), torch.zeros(1, 16, 32), torch.zeros(1, 16, dtype=torch.bool))  # page 0 emptied
    store.version[0, 0] += 1
    centroids = DeviceCentroids(store, torch.device(backend_device), torch.float32)
    picks = centroids.candidates(torch.randn(1, 2, 32, device=backend_device), 100).cpu()  # [1, 2, pages]
    found = picks[picks >= 0]
    assert 0 not in found.tolist() and len(found) == 2 * (store.num_pages.item() - 1)


def test_nothing_to_select(backend_device):
    empty = PageStore(2, 16, 32)
    centroids = DeviceCentroids(empty, torch.device(backend_device), torch.float32)
    q = torch.randn(2, 3, 32)
    picks = centroids.candidates(q.to(backend_device), 8)
    assert picks.shape == (2, 3, 0)
    assert all(len(x) == 0 for x in candidate_search(empty, q, picks.cpu().numpy(), 4, by_score=True))


@pytest.mark.skipif(not NATIVE, reason="bf16 tl.dot is wrong in triton's CPU interpreter")
def test_a_bf16_copy_nominates_nearly_the_same_pages(kdev):
    store, _ = index_layer([4000, 3000], d=128)
    centroids = DeviceCentroids(store, torch.device(kdev), torch.bfloat16)
    q = torch.randn(2, 4, 128)
    host, device_scored = _both(store, centroids, q, 96, 12)
    same = len(set(zip(*host[:2])) & set(zip(*device_scored[:2])))
    assert same >= 0.9 * len(host[0]) and np.all(device_scored[1] >= 0)
