"""The sparse decode kernel over quantized KV pages (packed int8 / fp8 e4m3 rows, decoded inside the
kernel) against its torch reference, in triton's interpreter, over awkward shapes; and the reference
against plain attention over the decoded pages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from icekv.kernels import reference, sparse_decode_attention
from icekv.kv.quant import KVFormat, as_words
from tests.kernels.conftest import DTYPES, HAS_TRITON, NATIVE, skip_unsupported
from tests.kernels.test_aot import no_interpreter_env
from tests.kernels.test_kernels import DTYPE_IDS, TOL, make_case

FORMATS = [KVFormat("int8"), KVFormat("fp8_e4m3")]
FORMAT_IDS = ["int8", "fp8"]
# batch, query heads per KV head, KV heads, head_dim, page size, page slots, selected pages
SHAPES = {
    "gqa7": (2, 7, 2, 64, 16, 9, 5),  # partial pages, one id -1, one length 0 (make_case)
    "gqa3-page8-d128": (1, 3, 3, 128, 8, 6, 4),  # pages below tl.dot's 16 rows, padded
    "one-page": (3, 1, 2, 64, 16, 4, 1),
}


def packed_case(kv_format: KVFormat, shape, dtype=torch.float32, seed=0, device="cpu"):
    """make_case's queries and selections over its pages packed in ``kv_format`` ([Hkv, S, P, D + 4] int8)."""
    q, k, v, ids, lens = make_case(*shape, dtype, seed=seed)
    return tuple(t.to(device) for t in (q, kv_format.pack(k), kv_format.pack(v), ids, lens))


def check_against_reference(q, k, v, ids, lens, kv_format, dtype=torch.float32):
    """Single kernel and split + merge, against the reference over the same packed pages."""
    want, want_lse = reference.sparse_decode_reference(q, k, v, ids, lens, kv_format=kv_format)
    for max_splits in (1, None):
        out, lse = sparse_decode_attention(q, k, v, ids, lens, max_splits=max_splits, kv_format=kv_format)
        assert out.dtype == q.dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
        torch.testing.assert_close(lse, want_lse, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_format", FORMATS, ids=FORMAT_IDS)
def test_quantized_decode_matches_reference(kdev, kv_format, dtype):
    skip_unsupported(dtype)
    check_against_reference(*packed_case(kv_format, SHAPES["gqa7"], dtype, device=kdev), kv_format, dtype)


@pytest.mark.parametrize("shape", list(SHAPES.values())[1:], ids=list(SHAPES)[1:])
@pytest.mark.parametrize("kv_format", FORMATS, ids=FORMAT_IDS)
def test_quantized_decode_page_shapes(kdev, kv_format, shape):
    check_against_reference(*packed_case(kv_format, shape, seed=shape[3], device=kdev), kv_format)


@pytest.mark.parametrize("kv_format", FORMATS, ids=FORMAT_IDS)
def test_quantized_decode_one_token_per_page(kdev, kv_format):
    q, k, v, ids, lens = packed_case(kv_format, SHAPES["gqa7"], seed=3, device=kdev)
    check_against_reference(q, k, v, ids, torch.ones_like(lens), kv_format)


@pytest.mark.parametrize("kv_format", FORMATS, ids=FORMAT_IDS)
def test_quantized_empty_selection_is_zero(kdev, kv_format):
    q, k, v, ids, lens = packed_case(kv_format, (2, 4, 2, 64, 16, 4, 3), device=kdev)
    none = ((ids[:, :, :0], lens[:, :, :0]), (torch.full_like(ids, -1), lens), (ids, torch.zeros_like(lens)))
    for sel, sel_lens in none:  # no page, every id -1, every length 0
        out, lse = sparse_decode_attention(q, k, v, sel.contiguous(), sel_lens.contiguous(), kv_format=kv_format)
        assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("kv_format", FORMATS, ids=FORMAT_IDS)
def test_masked_tokens_never_reach_the_result(kdev, kv_format):
    """NaN scales and codes past each page's valid tokens (a half-filled page's unwritten rows)
    change nothing: the kernel reads neither."""
    q, k, v, ids, lens = packed_case(kv_format, SHAPES["gqa7"], seed=5)
    ids[0, 1] = 2  # one page named with every length: tokens past each length are garbage
    lens[0, 1] = torch.tensor([1, 7, 16, 0, 3], dtype=torch.int32)
    valid = torch.zeros(k.shape[:3], dtype=torch.bool)  # [Hkv, S, P] rows some selection reads
    for b, h, j in torch.nonzero(ids >= 0).tolist():
        valid[h, ids[b, h, j], : lens[b, h, j]] = True
    dirty_k, dirty_v = k.clone(), v.clone()
    for pages in (dirty_k, dirty_v):
        pages[~valid] = 0x7F  # codes: int8 127, fp8 NaN
        as_words(pages)[..., -1][~valid] = float("nan")  # [Hkv, S, P] the rows' scales
    args = [t.to(kdev) for t in (q, k, v, ids, lens)]
    clean = sparse_decode_attention(*args, kv_format=kv_format)
    dirty = sparse_decode_attention(args[0], dirty_k.to(kdev), dirty_v.to(kdev), *args[3:], kv_format=kv_format)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    check_against_reference(*args, kv_format)


@pytest.mark.parametrize("kv_format", FORMATS, ids=FORMAT_IDS)
def test_quantized_reference_is_attention_over_the_decoded_pages(kv_format):
    """The reference itself: packed pages == the unquantized reference over ``unpack`` of them, and
    both near attention over the original pages (what quantization costs)."""
    q, k, v, ids, lens = make_case(2, 4, 2, 64, 16, 9, 5, torch.float32)
    pk, pv = kv_format.pack(k), kv_format.pack(v)
    assert pk.shape == (2, 9, 16, 68) and pk.dtype == torch.int8
    out, lse = reference.sparse_decode_reference(q, pk, pv, ids, lens, kv_format=kv_format)
    dk, dv = kv_format.unpack(pk, torch.float32), kv_format.unpack(pv, torch.float32)  # [Hkv, S, P, D]
    decoded = reference.sparse_decode_reference(q, dk, dv, ids, lens)
    torch.testing.assert_close(out, decoded[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, decoded[1], rtol=1e-6, atol=1e-6)
    original, _ = reference.sparse_decode_reference(q, k, v, ids, lens)
    torch.testing.assert_close(out, original, rtol=0, atol=0.03 if kv_format.name == "int8" else 0.1)


def test_packed_pages_are_validated():
    q, k, v, ids, lens = make_case(1, 2, 2, 64, 16, 4, 2, torch.float32)
    int8 = KVFormat("int8")
    with pytest.raises(ValueError, match="expected 68 for head_dim 64 packed"):
        sparse_decode_attention(q, int8.pack(k)[..., :64], int8.pack(v)[..., :64], ids, lens, kv_format=int8)
    with pytest.raises(ValueError, match="expected 64 for head_dim 64$"):
        sparse_decode_attention(q, int8.pack(k), int8.pack(v), ids, lens)  # packed pages, kv_format auto
    with pytest.raises(ValueError, match="packed int8 rows, got torch.float32"):
        sparse_decode_attention(q, torch.zeros(2, 4, 16, 68), torch.zeros(2, 4, 16, 68), ids, lens, kv_format=int8)


COMPILE_QUANTIZED = r"""
import dataclasses, json, torch
from icekv.kernels import aot
out = {}
for quant, lut in ((1, {}), (2, {"lut_ptr": "*fp32"})):
    for splits in (1, 8):
        spec = aot.decode_spec(torch.bfloat16, 8, 4, 128, 16, num_splits=splits)
        packed = {"k_ptr": "*i8", "v_ptr": "*i8", "k_words_ptr": "*fp32", "v_words_ptr": "*fp32", **lut}
        consts = {k: v for k, v in spec.constexprs.items() if k not in packed}
        spec = dataclasses.replace(spec, signature={**spec.signature, **packed},
                                   constexprs={**consts, "QUANT": quant, "ROW": 132})
        kernel = aot.compile_kernel(spec)
        extra = kernel.ptx_params - len(spec.signature)
        out[f"{quant}/{splits}"] = [extra, kernel.scratch_bytes, "mma" in kernel.ptx]
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pinned in requirements.txt)")
@pytest.mark.skipif(NATIVE, reason="on a GPU the tests above compile and run them natively")
def test_quantized_kernel_compiles_for_sm90():
    """The int8 and fp8 forms compile to sm_90 PTX (bf16 queries, single and split): what the
    interpreter cannot show, checked without a GPU. Their entries take the scale views and, for fp8,
    the code table as extra pointers; the unquantized entry is unchanged (tests/kernels/test_aot.py)."""
    run = subprocess.run([sys.executable, "-c", COMPILE_QUANTIZED], check=True, env=no_interpreter_env(),
                         capture_output=True, text=True, timeout=600)
    got = json.loads(run.stdout.splitlines()[-1])  # per form: entry parameters past the signature, scratch, MMA
    assert len(got) == 4
    for extra, scratch, mma in got.values():
        assert extra >= 0 and scratch == 0 and mma  # every signature argument reaches the entry; tensor cores
