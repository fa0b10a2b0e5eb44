"""Every kernel against its torch reference, in triton's interpreter, over awkward shapes."""

from __future__ import annotations

import pytest
import torch

from icekv.kernels import reference, scatter_pages, select_pages, sparse_decode_attention
from icekv.kernels.dispatch import kernel_backend
from tests.kernels.conftest import DTYPES, NATIVE, skip_unsupported

# fp32 on a GPU: tl.dot is asked for IEEE precision, torch's reference may use other summation orders
TOL = {torch.float32: dict(atol=1e-4 if NATIVE else 2e-5, rtol=1e-4 if NATIVE else 2e-5),
       torch.float16: dict(atol=4e-3, rtol=4e-3), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def make_case(batch, group, hkv, head_dim, page_size, n_slots, n_sel, dtype, seed=0, device="cpu"):
    """Random queries and pages; selections mix full, partial, empty (-1 / len 0) and repeated pages."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * group, head_dim, generator=g).to(dtype)
    k = torch.randn(hkv, n_slots, page_size, head_dim, generator=g).to(dtype)
    v = torch.randn(hkv, n_slots, page_size, head_dim, generator=g).to(dtype)
    ids = torch.randint(0, n_slots, (batch, hkv, n_sel), generator=g, dtype=torch.int32)
    lens = torch.randint(1, page_size + 1, (batch, hkv, n_sel), generator=g, dtype=torch.int32)
    if n_sel > 1:
        ids[0, 0, -1] = -1  # no page
        lens[-1, -1, 0] = 0  # a page with nothing valid
    return tuple(t.to(device) for t in (q, k, v, ids, lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sparse_decode_matches_reference(kdev, dtype, group, head_dim):
    skip_unsupported(dtype)
    q, k, v, ids, lens = make_case(2, group, 2, head_dim, 16, 9, 5, dtype, seed=group + head_dim, device=kdev)
    want, want_lse = reference.sparse_decode_reference(q, k, v, ids, lens)
    for max_splits in (1, None):  # single kernel (the plugin's) and split + merge
        out, lse = sparse_decode_attention(q, k, v, ids, lens, max_splits=max_splits)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
        torch.testing.assert_close(lse, want_lse, **TOL[torch.float32])


@pytest.mark.parametrize("page_size,n_sel", [(8, 3), (16, 1), (32, 4)], ids=["pad-small-page", "one-page", "page32"])
def test_sparse_decode_page_shapes(kdev, page_size, n_sel):
    q, k, v, ids, lens = make_case(1, 3, 3, 64, page_size, 6, n_sel, torch.float32, seed=page_size, device=kdev)
    out, lse = sparse_decode_attention(q, k, v, ids, lens)
    want, want_lse = reference.sparse_decode_reference(q, k, v, ids, lens)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(lse, want_lse, **TOL[torch.float32])


def test_sparse_decode_empty_selection_is_zero(kdev):
    q, k, v, ids, lens = make_case(2, 4, 2, 64, 16, 4, 3, torch.float32, device=kdev)
    for sel, sel_lens in ((ids[:, :, :0], lens[:, :, :0]), (torch.full_like(ids, -1), lens), (ids, torch.zeros_like(lens))):
        out, lse = sparse_decode_attention(q, k, v, sel.contiguous(), sel_lens.contiguous())
        assert torch.equal(out, torch.zeros_like(q))
        assert torch.isneginf(lse).all()
        ref_out, ref_lse = reference.sparse_decode_reference(q, k, v, sel, sel_lens)
        assert torch.equal(ref_out, out) and torch.equal(ref_lse, lse)


def test_sparse_decode_reference_equals_dense_attention():
    """The reference itself: named full pages == softmax over exactly those tokens."""
    q, k, v, _, _ = make_case(1, 4, 2, 64, 16, 5, 2, torch.float32)
    ids = torch.tensor([[[4, 1], [0, 2]]], dtype=torch.int32)
    lens = torch.tensor([[[16, 5], [16, 16]]], dtype=torch.int32)
    out, _ = reference.sparse_decode_reference(q, k, v, ids, lens)
    for h, (pages, n) in enumerate(zip(ids[0].tolist(), lens[0].tolist())):
        keys = torch.cat([k[h, p, :m] for p, m in zip(pages, n)])  # [T, D]
        vals = torch.cat([v[h, p, :m] for p, m in zip(pages, n)])
        qh = q[0, h * 4:(h + 1) * 4]  # [G, D]
        want = torch.softmax(qh @ keys.T / 8.0, -1) @ vals
        torch.testing.assert_close(out[0, h * 4:(h + 1) * 4], want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fused", [False, True], ids=["score+topk", "fused"])
def test_select_pages_matches_reference(kdev, dtype, group, head_dim, fused):
    skip_unsupported(dtype)
    q, k, _, ids, lens = make_case(2, group, 2, head_dim, 16, 12, 11, dtype, seed=group * head_dim, device=kdev)
    top, top_lens, scores = select_pages(q, k, ids, lens, k=4, fused=fused)
    want_scores = reference.page_scores_reference(q, k, ids, lens)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(want_scores))
    finite = torch.isfinite(want_scores)
    torch.testing.assert_close(scores[finite], want_scores[finite], **TOL[dtype])
    # the selection step is exact given the scores (near-ties may order differently across dtypes)
    want_top, want_lens = reference.topk_reference(scores, ids, lens, 4)
    assert torch.equal(top, want_top) and torch.equal(top_lens, want_lens)


def test_select_pages_fewer_candidates_than_k(kdev):
    q, k, _, ids, lens = make_case(1, 3, 3, 64, 16, 4, 3, torch.float32, device=kdev)
    lens[0, 1] = 0  # head 1 has no valid candidate
    for fused in (False, True):
        top, top_lens, _ = select_pages(q, k, ids, lens, k=5, fused=fused)
        assert top.shape == (1, 3, 5)
        assert (top[0, 1] == -1).all()
        n_valid = int(((ids[0, 0] >= 0) & (lens[0, 0] > 0)).sum())  # 2: make_case drops one
        assert (top[0, 0, :n_valid] >= 0).all() and (top[0, 0, n_valid:] == -1).all()
        assert ((top_lens > 0) == (top >= 0)).all()
        want_top, want_lens, _ = reference.page_select_reference(q, k, ids, lens, 5)
        assert torch.equal(top, want_top) and torch.equal(top_lens, want_lens)
    top, top_lens, scores = select_pages(q, k, ids[:, :, :0].contiguous(), lens[:, :, :0].contiguous(), k=2)
    assert (top == -1).all() and (top_lens == 0).all() and scores.shape == (1, 3, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_scatter_pages_matches_reference(kdev, dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    dst_k = torch.randn(3, 5, 16, head_dim, generator=g).to(dtype).to(kdev)
    dst_v = torch.randn(3, 5, 16, head_dim, generator=g).to(dtype).to(kdev)
    src_k, src_v = torch.randn(2, 4, 16, head_dim, generator=g).to(kdev)  # fp32 staging, cast on write
    heads, slots = torch.tensor([0, 2, 2, 1], device=kdev), torch.tensor([4, 0, 3, 4], device=kdev)
    want_k, want_v = dst_k.clone(), dst_v.clone()
    reference.scatter_pages_reference(want_k, want_v, src_k, src_v, heads, slots)
    scatter_pages(dst_k, dst_v, src_k, src_v, heads, slots)
    assert torch.equal(dst_k, want_k) and torch.equal(dst_v, want_v)
    scatter_pages(dst_k, dst_v, src_k[:0], src_v[:0], heads[:0], slots[:0])  # nothing to move
    assert torch.equal(dst_k, want_k)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("ICEKV_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernel_backend(torch.device("cpu")) == "numba"
    assert kernel_backend(torch.device("cpu"), "torch") == "torch"
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        kernel_backend(torch.device("meta"), "numba")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernel_backend(torch.device("cpu"), "triton")
    monkeypatch.setenv("ICEKV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="ICEKV_KERNELS"):
        kernel_backend(torch.device("cpu"))


def test_bad_inputs_are_named():
    q, k, v, ids, lens = make_case(1, 2, 2, 64, 16, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        sparse_decode_attention(q, k, v, ids.long(), lens)
    with pytest.raises(ValueError, match="multiple"):
        sparse_decode_attention(q[:, :3], k, v, ids, lens)
    with pytest.raises(ValueError, match=r"\[B=1, Hkv=2, K\]"):
        select_pages(q, k, ids[:, :1], lens[:, :1], 2)
    with pytest.raises(ValueError, match="do not fit"):
        scatter_pages(k, v, k[0, :2, :8], v[0, :2, :8], torch.tensor([0, 1]), torch.tensor([0, 1]))


def _unspecialised(kernel) -> set[str]:
    """The parameters a kernel declares ``do_not_specialize`` (compiled or interpreted)."""
    if hasattr(kernel, "params"):  # triton.JITFunction
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize") or ())  # the interpreter's function


def test_length_arguments_do_not_specialise_the_kernels():
    """Integer arguments that change as a decode grows (pages selected, candidates, slots, k)
    would otherwise compile a new variant whenever they become 1 or a multiple of 16."""
    from icekv.kernels.page_scatter import page_scatter_kernel
    from icekv.kernels.page_select import page_score_kernel, page_select_kernel, topk_kernel
    from icekv.kernels.sparse_decode import sparse_decode_kernel

    assert _unspecialised(sparse_decode_kernel) >= {"n_sel", "n_slots"}
    assert _unspecialised(page_score_kernel) >= {"n_cand", "n_slots"}
    assert _unspecialised(topk_kernel) >= {"n_cand", "k"}
    assert _unspecialised(page_select_kernel) >= {"n_cand", "n_slots", "k"}
    assert _unspecialised(page_scatter_kernel) >= {"n_slots"}


@pytest.mark.parametrize("n_sel", [1, 15, 16, 17, 33])  # 1 and multiples of 16 were specialised on
def test_sparse_decode_over_changing_lengths_matches_reference(kdev, n_sel):
    g = torch.Generator().manual_seed(n_sel)
    q = torch.randn(1, 8, 64, generator=g).to(kdev)
    k = torch.randn(2, 40, 16, 64, generator=g).to(kdev)
    v = torch.randn(2, 40, 16, 64, generator=g).to(kdev)
    ids = torch.randperm(40, generator=g)[:n_sel].int().expand(1, 2, n_sel).contiguous().to(kdev)
    lens = torch.randint(1, 17, (1, 2, n_sel), generator=g).int().to(kdev)
    out, lse = sparse_decode_attention(q, k, v, ids, lens)
    want, want_lse = reference.sparse_decode_reference(q.cpu(), k.cpu(), v.cpu(), ids.cpu(), lens.cpu(), 64 ** -0.5)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-4, atol=1e-4)
