"""The index's row formats: the compiled conversions equal the torch ones, bit for bit."""

import numba
import numpy as np
import pytest
import torch

from icekv.index.score_rows import decode, dots, encode, narrow, raw, row_width, widen, widen_page


@numba.njit(cache=True)
def _narrow_rows(x, out):
    for i in range(x.shape[0]):
        narrow(x[i], out[i])


@numba.njit(cache=True)
def _widen_rows(rows, d):
    out = np.empty((rows.shape[0], d), dtype=np.float32)
    buf = np.empty(d, dtype=np.float32)
    for i in range(rows.shape[0]):
        out[i] = widen(rows[i], buf)
    return out


@numba.njit(cache=True)
def _dots_rows(qh, rows):
    out = np.empty((rows.shape[0], qh.shape[0]), dtype=np.float32)
    buf = np.empty(qh.shape[1], dtype=np.float32)
    for i in range(rows.shape[0]):
        dots(qh, rows[i], buf, out[i])
    return out


@numba.njit(cache=True)
def _dots_page(qh, rows):
    """:func:`_dots_rows` with the rows widened at once, as a page."""
    out = np.empty((rows.shape[0], qh.shape[0]), dtype=np.float32)
    buf = np.empty(qh.shape[1], dtype=np.float32)
    page = widen_page(rows, np.empty((rows.shape[0], qh.shape[1]), dtype=np.float32))
    for i in range(rows.shape[0]):
        dots(qh, page[i], buf, out[i])
    return out


def _awkward_rows(d=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, d, generator=g) * torch.rand(40, 1, generator=g) * 50  # [n, D] varied norms
    x[0] = 0.0  # all zero
    x[1] = float("nan")  # an emptied page's mean key
    x[2, 3] = 1e-30  # one tiny entry in an otherwise zero row
    x[2, :3] = 0.0
    x[3, 5] = 1e4  # an outlier channel
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_compiled_rows_equal_the_torch_rows(dtype):
    x = _awkward_rows()
    rows = encode(x, dtype)  # [n, W]
    assert rows.dtype == dtype and rows.shape == (40, row_width(24, dtype))
    compiled = torch.zeros_like(rows)
    _narrow_rows(x.numpy(), raw(compiled))
    finite = slice(2, None) if dtype == torch.bfloat16 else slice(None)  # bf16 NaN payloads may differ
    assert torch.equal(compiled[finite].view(torch.uint8), rows[finite].view(torch.uint8))
    widened = torch.from_numpy(_widen_rows(raw(rows), 24))
    assert torch.equal(widened.view(torch.int32)[2:], decode(rows).view(torch.int32)[2:])
    assert bool(torch.isnan(widened[1]).all()) and bool(torch.isnan(decode(rows)[1]).all())
    assert not decode(rows)[0].any()


def test_int8_rows_keep_each_key_to_half_a_step_of_its_own_scale():
    x = _awkward_rows()[2:]
    rows = encode(x, torch.int8)
    step = x.abs().amax(-1, keepdim=True) / 127  # [n, 1] no row clips: its largest entry is 127 steps
    assert bool(((decode(rows) - x).abs() <= step / 2 * (1 + 1e-5)).all())
    assert bool((rows[:, :-4].abs().amax(-1) == 127).all())
    assert torch.equal(encode(decode(rows), torch.int8), rows)  # re-encoding a stored row keeps it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("g", [1, 3])
def test_compiled_dots_are_the_products_with_the_decoded_keys(dtype, g):
    rows = encode(_awkward_rows(), dtype)  # [n, W]
    qh = torch.randn(g, 24, generator=torch.Generator().manual_seed(3))  # [G, D]
    got = torch.from_numpy(_dots_rows(qh.numpy(), raw(rows)))  # [n, G]
    want = decode(rows) @ qh.T  # [n, G]
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and not bool(finite[1].any())  # the NaN row stays NaN
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5 * float(want[finite].abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_page_widened_at_once_scores_as_its_rows_one_by_one(dtype):
    rows = raw(encode(_awkward_rows(), dtype))  # [n, W]
    qh = torch.randn(3, 24, generator=torch.Generator().manual_seed(4)).numpy()  # [G, D]
    np.testing.assert_array_equal(_dots_page(qh, rows), _dots_rows(qh, rows))  # NaN rows compare equal
