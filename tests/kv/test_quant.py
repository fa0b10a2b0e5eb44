"""Quantized KV rows: round-trip error bounds per format, and the page pool storing them (writes
quantize, value readers decode, row copies carry each token's scale)."""

import pytest
import torch

from icekv.config.paging import PagingConfig
from icekv.kv import PagedKVCache
from icekv.kv.quant import SCALE_BYTES, KVFormat, as_words

QUANTIZED = ("int8", "fp8_e4m3")


def rows(*shape, seed=0):
    """K/V-like values: a few large channels, as post-RoPE keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :2] *= 20
    return x


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 16), (2, 4, 7, 64), (1, 1, 1, 128)])
def test_int8_error_is_at_most_half_a_step(shape):
    """Each value is within half a code step (absmax / 254) of its row's original."""
    fmt, x = KVFormat("int8"), rows(*shape)
    packed = fmt.pack(x)
    assert packed.shape == (*shape[:-1], shape[-1] + SCALE_BYTES) and packed.dtype == torch.int8
    err = (fmt.unpack(packed, torch.float32) - x).abs()
    step = x.abs().amax(-1, keepdim=True) / 127
    assert (err <= step / 2 * (1 + 1e-5)).all()
    assert err.max() > 0  # it does quantize


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 16), (2, 4, 7, 64)])
def test_fp8_error_is_relative(shape):
    """e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of the smallest normal step for
    values in its subnormal range (relative to the row's scale)."""
    fmt, x = KVFormat("fp8_e4m3"), rows(*shape, seed=1)
    got = fmt.unpack(fmt.pack(x), torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    bound = torch.maximum(x.abs() / 16, scale * 2.0**-9)
    assert ((got - x).abs() <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_zero_rows_and_scales(kv_dtype):
    fmt = KVFormat(kv_dtype)
    x = torch.zeros(2, 3, 8)
    x[1, 2] = torch.arange(8.0) - 3
    packed = fmt.pack(x)
    assert torch.equal(fmt.unpack(packed, torch.float32)[0], x[0])  # zeros stay zeros (scale 1)
    assert fmt.scales(packed)[1, 2].item() == pytest.approx(4 / (127 if kv_dtype == "int8" else 448))
    assert torch.equal(as_words(packed)[..., 2:3], fmt.scales(packed))  # the scale is word D / 4
    lut = fmt.lut()
    codes = packed[..., :8]
    decoded = (codes.float() if lut is None else lut[codes.long() & 0xFF]) * fmt.scales(packed)
    assert torch.equal(decoded, fmt.unpack(packed, torch.float32))  # the kernels' decoding agrees


def test_auto_is_the_identity_and_bad_formats_are_named():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert KVFormat().pack(x) is x and KVFormat().unpack(x, torch.bfloat16) is x
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, int8, fp8_e4m3"):
        KVFormat("int4")
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        KVFormat("int8").row_width(30)


@pytest.mark.parametrize("kv_dtype,model_bytes,share", [("int8", 4, 68 / 256), ("fp8_e4m3", 2, 68 / 128),
                                                         ("auto", 2, 1.0)])
def test_stored_bytes_per_token(kv_dtype, model_bytes, share):
    """64 codes and a 4-byte scale per row: 0.27x of fp32, 0.53x of bf16."""
    assert KVFormat(kv_dtype).row_bytes(64, model_bytes) / (64 * model_bytes) == pytest.approx(share)
    dtype = {4: torch.float32, 2: torch.bfloat16}[model_bytes]
    cache = PagedKVCache(3, 2, 64, PagingConfig(page_size=4, pool_tokens=64), dtype, kv_format=KVFormat(kv_dtype))
    assert cache.bytes_per_token == round(3 * 2 * 2 * 64 * model_bytes * share)
    assert cache.value_bytes_per_token == 3 * 2 * 2 * 64 * model_bytes


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_pool_stores_rows_and_reads_values(kv_dtype):
    """Prefill chunks, single decode tokens and batched row writes all land as packed rows; every
    value reader gives the decoded values; gather_tokens gives the stored rows themselves."""
    fmt = KVFormat(kv_dtype)
    hkv, d, p = 2, 16, 4
    cache = PagedKVCache(2, hkv, d, PagingConfig(page_size=p, pool_tokens=64), kv_format=fmt)
    cache.add(0), cache.add(1)
    k, v = rows(11, hkv, d, seed=2), rows(11, hkv, d, seed=3)
    cache.write(1, 0, cache.extend(0, 7), k[:7], v[:7])  # a chunk: partial last page
    cache.write(1, 1, cache.extend(1, 2), k[:2], v[:2])  # another request between: pages not consecutive
    for t in range(7, 11):  # decode steps, one token each
        cache.write(1, 0, cache.extend(0, 1), k[t : t + 1], v[t : t + 1])
    want_k, want_v = (fmt.unpack(fmt.pack(x), torch.float32).transpose(0, 1) for x in (k, v))  # [Hkv, 11, D]
    got_k, got_v = cache.gather(1, 0)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    runs = cache.view_runs(1, 0, 2, 11)
    assert torch.equal(torch.cat([r[0] for r in runs], 1), want_k[:, 2:])
    assert torch.equal(cache.view_range(1, 0, 3, 9)[1], want_v[:, 3:9])
    heads, positions = torch.tensor([1, 0]), torch.tensor([[10, -1, 3, 0], [5, 6, 7, -1]])
    stored = cache.gather_tokens(1, 0, heads, positions)  # [2, n, P, W]
    assert stored.shape == (2, 2, 4, d + SCALE_BYTES) and stored.dtype == torch.int8
    values = fmt.unpack(stored, torch.float32)
    assert torch.equal(values[0, 0, 0], want_k[1, 10]) and torch.equal(values[1, 1, 2], want_v[0, 7])
    assert (stored[:, 0, 1] == 0).all()  # -1: zeros
    assert torch.equal(cache.as_stored(k[4]), want_k[:, 4])


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_write_rows_and_copy_on_write_carry_scales(kv_dtype):
    """Batched decode writes quantize; truncating inside a cached page copies it whole, scales
    and all."""
    from icekv.kv import PrefixCache

    fmt = KVFormat(kv_dtype)
    cache = PagedKVCache(1, 1, 8, PagingConfig(page_size=4, pool_tokens=64), kv_format=fmt,
                         prefix=PrefixCache("m", 4))
    prompt = list(range(8))
    cache.add(0)
    x = rows(8, 1, 8, seed=4)
    cache.write(0, 0, cache.extend(0, 8), x, -x)
    cache.free(0, prompt)  # both pages cached
    cache.add(1, prompt, most_cached=8)
    cache.truncate(1, 6)  # back inside the second cached page: a copy of its own
    assert cache.extend(1, 1) == 6
    cache.write_rows(0, cache.page_ids(1)[1:2], torch.tensor([2]), x[6:7] * 3, x[6:7])
    k, _ = cache.gather(0, 1)
    assert torch.equal(k[0, :6], fmt.unpack(fmt.pack(x[:6, 0]), torch.float32))
    assert torch.equal(k[0, 6], fmt.unpack(fmt.pack(x[6, 0] * 3), torch.float32))
    cache.add(2, prompt, most_cached=8)  # the cached page itself is unchanged
    assert torch.equal(cache.gather(0, 2)[0][0, 6], fmt.unpack(fmt.pack(x[6, 0]), torch.float32))
