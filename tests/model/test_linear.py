"""The few-row CPU linear form against F.linear, over the row counts and layouts a step produces."""

import pytest
import torch
import torch.nn.functional as F

from icekv.model.linear import STREAMED_ROWS, Linear, streams_weight


@pytest.mark.parametrize("rows", [1, 2, 3, 8, STREAMED_ROWS, STREAMED_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)  # [N, in]
    y = layer(x)
    assert y.shape == (rows, 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_non_contiguous_input():
    """A strided input (a column slice) gives the same product."""
    layer = Linear(64, 32, bias=False)
    wide = torch.randn(4, 128)
    x = wide[:, ::2]  # [4, 64], stride 2
    torch.testing.assert_close(layer(x), F.linear(x.contiguous(), layer.weight), rtol=1e-5, atol=1e-5)


def test_one_row_equals_its_row_in_a_pair():
    """One row is computed as a two-column product, so it equals that row of a two-row batch."""
    layer = Linear(96, 200, bias=True)
    x = torch.randn(2, 96)
    assert torch.equal(layer(x[:1]), layer(x)[:1])


def test_which_inputs_stream():
    assert streams_weight(torch.zeros(STREAMED_ROWS, 8))
    assert not streams_weight(torch.zeros(STREAMED_ROWS + 1, 8))  # a prefill chunk: F.linear
    assert not streams_weight(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not streams_weight(torch.zeros(2, 3, 8))  # not a flat batch


def test_checkpoint_names_unchanged():
    assert set(Linear(4, 3, bias=True).state_dict()) == {"weight", "bias"}
