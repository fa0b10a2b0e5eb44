"""The few-row CPU linear forms against F.linear, over the row counts and layouts a step produces."""

import pytest
import torch
import torch.nn.functional as F

from icekv.model import linear as linear_module
from icekv.model.linear import COMPILED_ROWS, STREAMED_ROWS, Linear, compiled_linear, streamed_linear, streams_weight


@pytest.mark.parametrize("rows", [1, 2, 3, 5, COMPILED_ROWS, COMPILED_ROWS + 1, STREAMED_ROWS, STREAMED_ROWS + 1, 300])
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


@pytest.mark.parametrize("form", [compiled_linear, streamed_linear])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (33, 130), (5, 1000)])
def test_each_form_equals_f_linear_on_awkward_shapes(form, shape):
    """Odd widths, one output, one input feature; a strided weight view."""
    torch.manual_seed(sum(shape))
    out_features, in_features = shape
    weight = torch.randn(in_features, out_features).T  # [out, in], not contiguous
    bias = torch.randn(out_features)
    for rows in (1, 3, 4, 6):
        x = torch.randn(rows, in_features)
        tolerance = 1e-6 * in_features  # fp32 sums of in_features products, in another order
        torch.testing.assert_close(form(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=tolerance)


def test_a_row_reads_the_same_alone_or_in_a_batch():
    """The compiled loop sums each row's products in one order whatever the batch, so a request's
    row is the same whatever else the step holds (up to the compiled form's row count); 203
    outputs: the last three weight rows take the loop's tail."""
    layer = Linear(96, 203, bias=True)
    x = torch.randn(COMPILED_ROWS, 96)  # [8, 96]
    alone = [layer(x[r:r + 1]) for r in range(COMPILED_ROWS)]  # each [1, 203]
    assert all(torch.equal(layer(x[:n])[r:r + 1], alone[r]) for n in range(2, COMPILED_ROWS + 1) for r in range(n))


@pytest.mark.parametrize("units", [False, True])
def test_which_inputs_stream(units, monkeypatch):
    monkeypatch.setattr(linear_module, "bf16_units", lambda device: units)
    assert streams_weight(torch.zeros(STREAMED_ROWS, 8))
    assert not streams_weight(torch.zeros(STREAMED_ROWS + 1, 8))  # a prefill chunk: F.linear
    assert streams_weight(torch.zeros(2, 8, dtype=torch.bfloat16)) == units  # bf16 weights stream on bf16 units
    assert not streams_weight(torch.zeros(2, 8, dtype=torch.float16))
    assert not streams_weight(torch.zeros(2, 3, 8))  # not a flat batch


def test_checkpoint_names_unchanged():
    assert set(Linear(4, 3, bias=True).state_dict()) == {"weight", "bias"}
