"""The batched paged decode (numba, CPU; triton) against its torch reference, and the reference against
plain attention over each request's contiguous keys, over awkward shapes, in the model dtype and over
packed quantized pools."""

import pytest
import torch

from icekv.attention import decode_attention
from icekv.kernels import paged_decode_attention
from icekv.kernels.cpu_decode import paged_decode_cpu
from icekv.kernels.reference import paged_decode_reference
from icekv.kv import PageTable
from icekv.kv.quant import KVFormat


def _batch(lengths, hq=6, hkv=2, d=16, page_size=4, pool_pages=64, seed=0):
    """Requests of ``lengths`` tokens on shuffled (non-consecutive) pages of one pool layer."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, hkv, pool_pages, page_size, d, generator=g)  # [2, Hkv, pages, P, D]
    order = torch.randperm(pool_pages, generator=g)
    ids, starts, at = [], [], 0
    for n in lengths:
        pages = -(-n // page_size)
        starts.append(at)
        ids.append(order[at : at + pages])
        at += pages
    q = torch.randn(len(lengths), hq, d, generator=g)  # [B, Hq, D]
    return q, pool, torch.cat(ids), torch.tensor(starts), torch.tensor(lengths)


def _table(ids, starts, lens, page_size=4) -> PageTable:
    """The batch's page table, as the engine hands it to the dispatch."""
    return PageTable.build([ids[int(s) : int(s) + -(-int(n) // page_size)].tolist() for s, n in zip(starts, lens)],
                           lens.tolist(), page_size)


@pytest.mark.parametrize("lengths", [[1], [4], [5], [1, 9, 4, 17], [33, 2]])  # one token, full and partial pages
@pytest.mark.parametrize("hq, hkv", [(6, 2), (2, 2), (8, 1)])  # GQA groups of 3, none, all heads on one
def test_compiled_matches_reference(lengths, hq, hkv):
    q, pool, ids, starts, lens = _batch(lengths, hq, hkv)
    torch.testing.assert_close(paged_decode_cpu(q, pool, ids, starts, lens),
                               paged_decode_reference(q, pool, ids, starts, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [[1], [5], [1, 9, 4, 17], [33, 2]])
@pytest.mark.parametrize("hq, hkv", [(6, 2), (8, 1)])
def test_compiled_reads_a_bf16_pool(lengths, hq, hkv):
    """bf16 queries over a bf16 pool, widened as read: the reference over the same values in fp32."""
    q, pool, ids, starts, lens = _batch(lengths, hq, hkv)
    q, pool = q.bfloat16(), pool.bfloat16()
    out = paged_decode_attention(q, pool, _table(ids, starts, lens))  # the dispatch takes the compiled loop
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, paged_decode_cpu(q, pool, ids, starts, lens), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), paged_decode_reference(q.float(), pool.float(), ids, starts, lens),
                               rtol=1e-2, atol=1e-2)


def test_reference_is_attention_over_each_requests_tokens():
    q, pool, ids, starts, lens = _batch([7, 12, 3])
    out = paged_decode_reference(q, pool, ids, starts, lens)
    for i, n in enumerate(lens.tolist()):
        pages = ids[int(starts[i]) : int(starts[i]) + -(-n // 4)]
        k, v = (pool[j][:, pages].flatten(1, 2)[:, :n] for j in (0, 1))  # [Hkv, n, D]
        torch.testing.assert_close(out[i], decode_attention(q[i], k, v))


def test_a_request_gets_the_same_bits_alone_and_in_a_batch():
    """What makes a request's greedy tokens independent of the batch it decodes in."""
    q, pool, ids, starts, lens = _batch([9, 30, 5, 16])
    together = paged_decode_cpu(q, pool, ids, starts, lens)
    for i in range(4):
        alone = paged_decode_cpu(q[i : i + 1], pool, ids, starts[i : i + 1], lens[i : i + 1])
        assert torch.equal(alone[0], together[i])


def test_dispatch_falls_back_to_the_reference_off_fp32():
    q, pool, ids, starts, lens = _batch([6, 11])
    half = paged_decode_attention(q.double(), pool.double(), _table(ids, starts, lens))  # not fp32: the reference
    torch.testing.assert_close(half.float(), paged_decode_cpu(q, pool, ids, starts, lens), rtol=1e-5, atol=1e-5)
    assert half.dtype == torch.float64


def test_per_head_table_names_each_requests_pages_per_head():
    q, pool, ids, starts, lens = _batch([5, 1, 8])  # partial, one token, two full pages (P = 4)
    page_ids, page_lens = _table(ids, starts, lens).per_head(num_kv_heads=2)
    assert page_ids.shape == page_lens.shape == (3, 2, 2) and page_ids.dtype == torch.int32
    assert page_lens[:, 0].tolist() == [[4, 1], [1, 0], [4, 4]]
    assert page_ids[1, :, 1].tolist() == [-1, -1]  # padding past a request's pages
    assert page_ids[2, 1].tolist() == ids[int(starts[2]) : int(starts[2]) + 2].tolist()
    assert torch.equal(page_ids[:, 0], page_ids[:, 1])


@pytest.mark.parametrize("lengths", [[1], [5], [1, 9, 4, 17], [33, 2]])
@pytest.mark.parametrize("hq, hkv", [(6, 2), (8, 1)])
def test_triton_paged_decode_matches_reference(kdev, lengths, hq, hkv):
    """Under triton (the CUDA path; here the interpreter) the full decode runs the sparse decode
    kernel over every page of each request."""
    q, pool, ids, starts, lens = _batch(lengths, hq, hkv)
    out = paged_decode_attention(q.to(kdev), pool.to(kdev), _table(ids, starts, lens))
    torch.testing.assert_close(out.cpu(), paged_decode_reference(q, pool, ids, starts, lens), rtol=1e-4, atol=1e-4)


QUANTIZED = [KVFormat("int8"), KVFormat("fp8_e4m3")]


@pytest.mark.parametrize("kv_format", QUANTIZED, ids=["int8", "fp8"])
def test_quantized_reference_is_the_reference_over_the_decoded_pool(kv_format):
    q, pool, ids, starts, lens = _batch([7, 12, 3])
    packed = kv_format.pack(pool)  # [2, Hkv, pages, P, D + 4] int8
    torch.testing.assert_close(paged_decode_reference(q, packed, ids, starts, lens, kv_format),
                               paged_decode_reference(q, kv_format.unpack(packed, torch.float32), ids, starts, lens),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths", [[1, 9, 4, 17], [33, 2]])  # one token, full and partial pages
@pytest.mark.parametrize("hq, hkv", [(6, 2), (7, 1)])  # GQA groups of 3 and 7
@pytest.mark.parametrize("kv_format", QUANTIZED, ids=["int8", "fp8"])
def test_quantized_paged_decode_matches_reference(backend_device, kv_format, lengths, hq, hkv):
    """A packed pool through the dispatch: the reference (torch) or the sparse decode kernel over
    every page, decoding inside the kernel (triton)."""
    q, pool, ids, starts, lens = _batch(lengths, hq, hkv)
    packed = kv_format.pack(pool)
    dev = backend_device
    out = paged_decode_attention(q.to(dev), packed.to(dev), _table(ids, starts, lens), kv_format=kv_format)
    torch.testing.assert_close(out.cpu(), paged_decode_reference(q, packed, ids, starts, lens, kv_format),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_format", QUANTIZED, ids=["int8", "fp8"])
def test_quantized_paged_decode_compiled_on_cpu(monkeypatch, kv_format):
    """fp32 queries over a packed pool on a CPU take the compiled loops (numba)."""
    monkeypatch.setenv("ICEKV_KERNELS", "numba")
    q, pool, ids, starts, lens = _batch([1, 9, 4, 17])
    packed = kv_format.pack(pool)
    torch.testing.assert_close(paged_decode_attention(q, packed, _table(ids, starts, lens), kv_format=kv_format),
                               paged_decode_reference(q, packed, ids, starts, lens, kv_format), rtol=1e-5, atol=1e-5)


def test_compiled_loops_read_every_fp8_code_as_torch_does():
    """The CPU kernels decode fp8 e4m3 codes through fp16 bits: every code but the two NaNs (never
    stored: the quantizer clamps to +-448) reads exactly as torch decodes it, times the row's scale,
    subnormals and -0.0 included."""
    import numpy as np

    from icekv.kernels.cpu_decode import _fp8_row

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float() * 0.375
    got = torch.from_numpy(_fp8_row(codes.numpy(), np.float32(0.375), np.empty(len(codes), np.float32)))
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


# sliding windows: each request's first visible position, inside a page, on a page's first slot, its
# last token alone (a window of one), and 0 (the window covers it all)
WINDOWED = [([9, 30, 5, 17], [3, 8, 4, 0]), ([33, 2], [32, 1]), ([1, 12], [0, 11])]


@pytest.mark.parametrize("lengths, first_visible", WINDOWED)
@pytest.mark.parametrize("hq, hkv", [(6, 2), (8, 1)])
def test_a_window_is_attention_over_its_tokens_alone(lengths, first_visible, hq, hkv):
    q, pool, ids, starts, lens = _batch(lengths, hq, hkv)
    seen = torch.tensor(first_visible)
    out = paged_decode_reference(q, pool, ids, starts, lens, first_visible=seen)
    for i, n in enumerate(lens.tolist()):
        pages = ids[int(starts[i]) : int(starts[i]) + -(-n // 4)]
        k, v = (pool[j][:, pages].flatten(1, 2)[:, first_visible[i]:n] for j in (0, 1))  # [Hkv, window, D]
        torch.testing.assert_close(out[i], decode_attention(q[i], k, v))
    torch.testing.assert_close(paged_decode_cpu(q, pool, ids, starts, lens, first_visible=seen), out,
                               rtol=1e-5, atol=1e-5)
    # through the dispatch: the compiled loop over fp32 and over a packed pool
    torch.testing.assert_close(paged_decode_attention(q, pool, _table(ids, starts, lens), first_visible=seen), out,
                               rtol=1e-5, atol=1e-5)
    packed = KVFormat("int8").pack(pool)
    torch.testing.assert_close(
        paged_decode_attention(q, packed, _table(ids, starts, lens), kv_format=KVFormat("int8"), first_visible=seen),
        paged_decode_reference(q, packed, ids, starts, lens, KVFormat("int8"), seen), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths, first_visible", WINDOWED)
def test_a_window_under_triton_is_the_reference(kdev, lengths, first_visible, monkeypatch):
    """The sparse decode kernel reads pages from their first slot: a sliding-window layer takes the
    reference on triton's device, windows at 0 too, so that a request's path never depends on its
    batch; a layer without windows stays on the kernel."""
    import icekv.kernels.reference as reference

    q, pool, ids, starts, lens = _batch(lengths)
    seen = torch.tensor(first_visible)
    want = paged_decode_reference(q, pool, ids, starts, lens, first_visible=seen)
    calls = []
    monkeypatch.setattr(reference, "paged_decode_reference",
                        lambda *args, **kwargs: calls.append(len(args[0])) or paged_decode_reference(*args, **kwargs))
    table = _table(ids, starts, lens)
    torch.testing.assert_close(paged_decode_attention(q.to(kdev), pool.to(kdev), table, first_visible=seen).cpu(),
                               want, rtol=1e-4, atol=1e-4)
    paged_decode_attention(q.to(kdev), pool.to(kdev), table, first_visible=torch.zeros_like(seen))
    assert calls == [len(lengths)] * 2
    paged_decode_attention(q.to(kdev), pool.to(kdev), table)
    assert len(calls) == 2


@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_a_request_in_a_window_gets_the_same_bits_alone_and_in_a_batch(backend, request):
    """In a sliding-window layer too, what a request computes does not depend on its batch mates
    (one still within its window, one past it)."""
    dev = request.getfixturevalue("kdev") if backend == "triton" else "cpu"
    q, pool, ids, starts, lens = _batch([9, 30, 5])
    seen = torch.tensor([0, 7, 0])
    q, pool = q.to(dev), pool.to(dev)
    together = paged_decode_attention(q, pool, _table(ids, starts, lens), first_visible=seen)
    for i in range(3):
        alone = paged_decode_attention(q[i : i + 1], pool, _table(ids[int(starts[i]):], starts[i : i + 1] * 0,
                                                                  lens[i : i + 1]), first_visible=seen[i : i + 1])
        assert torch.equal(alone[0], together[i])
