"""Linear weights stored smaller than the compute dtype: bfloat16, or weight-only int8 / int4.

A decode step reads every weight once, so its time is the weights' bytes over memory bandwidth:
each format stores the weight as small as it allows, and few rows multiply through torch's
maintained kernels in bfloat16 (or a compiled loop, below). A prefill chunk is compute-bound, so
its products run in bfloat16 where the hardware has bf16 units
(:func:`icekv.model.linear.bf16_units`) and in float32 on a CPU without them, whose bf16 matmuls
are emulated and several times slower. Everything else
(norms, rotary, attention, the KV cache, the residual stream) keeps the engine's compute dtype:

- ``bfloat16``: the checkpoint's own bf16 weights (lossless for bf16 checkpoints), few rows on a
  CPU through :func:`icekv.model.linear.linear`;
- ``int8``: symmetric, one scale per output channel; on a CPU without bf16 units a decode step's
  float32 rows go through the compiled loop of :mod:`icekv.model.linear`, which widens the codes
  as it reads them, and other few rows through ``_weight_int8pack_mm``; more rows (or input widths
  the kernel cannot take) dequantize the weight for one matmul;
- ``int4``: asymmetric, a scale and a zero per group of input channels, packed for
  ``_weight_int4pack_mm_for_cpu`` on a CPU (its layout is the kernel's own, so every row count goes
  through it), or kept as two codes per byte and dequantized elsewhere.

The tests compare each kernel with ``F.linear`` on the weight that the quantizers' codes stand for
(:func:`quantize_int8`, :func:`quantize_int4` and :func:`dequantize_int4` are that reference).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from icekv.model.linear import COMPILED_ROWS, bf16_units, compiled_linear, linear

PRODUCT_DTYPE = torch.bfloat16  # what the weight-only kernels multiply in, and the dtype of their scales
KERNEL_ROWS = 16  # at most this many rows take the int8 kernel, or a bf16 weight's own product, on a CPU
INT8_KERNEL_IN = 16  # the CPU int8 kernel reads inputs in blocks of this many (others: wrong sums, unchecked)
INT4_GROUP = 32  # input channels per int4 scale and zero (wider groups lose far more accuracy)
INT4_KERNEL_OUT = 16  # the CPU int4 kernel packs output channels in blocks of this many
OUTPUT_LAYER = "lm_head"  # the decoder's output layer, by module name
# A CPU product of many rows dequantizes a weight of at most DEQUANTIZED_WHOLE_BYTES whole (glibc's heap reuses
# such a block; a larger one is mapped afresh and faulted in for every chunk of rows), a larger one
# DEQUANTIZED_BLOCK_BYTES at a time.
DEQUANTIZED_WHOLE_BYTES, DEQUANTIZED_BLOCK_BYTES = 32 << 20, 8 << 20
QUANTIZED_ROWS = 4096  # output channels quantized at a time: bounds a large layer's float temporaries


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> codes [out, in] int8 and scales [out] float32, ``weight ≈ codes * scale``."""
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
    codes = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return codes, scales


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> codes [out, in] in 0..15 (uint8), scales and zeros [out, in/group] float32,
    with ``weight ≈ (codes - 8) * scale + zero`` per group (the convention of torch's int4 kernels)."""
    out_features, in_features = weight.shape
    grouped = weight.float().view(out_features, in_features // group, group)  # [out, G, group]
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [out, G]
    scales = (high - low).clamp(min=1e-12) / 15  # [out, G]
    codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15)  # [out, G, group]
    return codes.to(torch.uint8).view(out_features, in_features), scales, low + 8 * scales


def by_row_blocks(quantize, weight: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """``quantize(weight, *args)`` (a quantizer of each output channel on its own) run over blocks of
    ``QUANTIZED_ROWS`` rows of ``weight`` [out, in], its outputs joined along the rows."""
    starts = range(0, weight.shape[0], QUANTIZED_ROWS)
    blocks = [quantize(weight[start:start + QUANTIZED_ROWS], *args) for start in starts]
    return tuple(torch.cat(parts) for parts in zip(*blocks))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] in 0..15 -> [out, in / 2] uint8, two a byte, the even input in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles` undone: [out, in / 2] uint8 -> codes [out, in]."""
    return torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (0..15), scales and zeros [out, G] -> weight [out, in] in the scales' dtype."""
    out_features, in_features = codes.shape
    grouped = codes.view(out_features, scales.shape[1], -1).to(scales.dtype)  # [out, G, group]
    return ((grouped - 8) * scales[..., None] + zeros[..., None]).view(out_features, in_features)


def layer_format(name: str, weights: str) -> str:
    """The format the linear layer ``name`` is stored in under ``weights``: the output layer of an
    int4 model in int8, as llama.cpp's Q4_K_M keeps it in Q6_K (every logit is a product with it)."""
    return "int8" if weights == "int4" and name == OUTPUT_LAYER else weights


def stored_apart(weights: str, dtype: str) -> bool:
    """Whether linear weights of format ``weights`` are stored otherwise than in the compute
    ``dtype`` (a dtype's name): what changes the model's bytes and identity."""
    return weights not in ("auto", dtype)


def int4_fits(in_features: int, out_features: int) -> bool:
    """Whether a layer of this shape can be stored in int4 (whole groups, the kernel's blocks)."""
    return in_features % INT4_GROUP == 0 and out_features % INT4_KERNEL_OUT == 0


class WeightOnlyLinear(nn.Module):
    """What the stored formats share: the input flattened to rows, the product in the form that
    suits the rows, the output back in the input's dtype plus the bias."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features)).to(x.dtype)  # [N, out]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, in] -> rows @ weight.T [N, out], in the dtype of the form that computes it."""
        raise NotImplementedError

    def dequantized_product(self, rows: torch.Tensor, block_rows: int | None = None) -> torch.Tensor:
        """rows [N, in] @ the dequantized weight, in bf16 where the hardware has bf16 units, in
        float32 elsewhere. ``block_rows`` output channels are dequantized at a time, each block
        multiplied before the next is made; by default, on a CPU, DEQUANTIZED_BLOCK_BYTES of a
        weight whose float form exceeds DEQUANTIZED_WHOLE_BYTES, else the whole weight: a large
        one whole would be mapped, written and read back for every chunk of rows, which costs
        more than the product itself in a large model. The blocks' products are joined into a new
        [N, out] tensor."""
        dtype = PRODUCT_DTYPE if bf16_units(rows.device) else torch.float32
        rows = rows.to(dtype)
        if block_rows is None:
            row_bytes = self.in_features * dtype.itemsize
            small = rows.device.type != "cpu" or self.out_features * row_bytes <= DEQUANTIZED_WHOLE_BYTES
            block_rows = self.out_features if small else max(DEQUANTIZED_BLOCK_BYTES // row_bytes, 1)
        if block_rows >= self.out_features:
            return linear(rows, self.dequantized(dtype), None)  # [N, out]
        return torch.cat([linear(rows, self.dequantized(dtype, first, first + block_rows), None)  # [N, block]
                          for first in range(0, self.out_features, block_rows)], dim=1)  # [N, out]

    def dequantized(self, dtype: torch.dtype = PRODUCT_DTYPE, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Rows [first, last) of the weight [out, in] the stored form stands for, in ``dtype``."""
        raise NotImplementedError


def kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [N, in] as torch's weight-only kernels take them: bf16, contiguous."""
    return rows.to(PRODUCT_DTYPE).contiguous()


class BF16Linear(WeightOnlyLinear):
    """A linear layer with bfloat16 weights under a wider compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.detach().to(PRODUCT_DTYPE))  # [out, in]

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] <= KERNEL_ROWS or bf16_units(rows.device):
            return linear(kernel_rows(rows), self.weight, None)
        return self.dequantized_product(rows)

    def dequantized(self, dtype: torch.dtype = PRODUCT_DTYPE, first: int = 0, last: int | None = None) -> torch.Tensor:
        return self.weight[first:last].to(dtype)


class Int8Linear(WeightOnlyLinear):
    """Weight-only int8, one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        codes, scales = by_row_blocks(quantize_int8, weight)
        self.register_buffer("codes", codes)  # [out, in] int8
        self.register_buffer("scales", scales.to(PRODUCT_DTYPE))  # [out]

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type != "cpu":
            return self.dequantized_product(rows)
        if rows.dtype == torch.float32 and rows.shape[0] <= COMPILED_ROWS and not bf16_units(rows.device):
            return compiled_linear(rows, self.codes, None).mul_(self.scales.float())  # [N, out]
        if rows.shape[0] <= KERNEL_ROWS and self.in_features % INT8_KERNEL_IN == 0:
            return torch.ops.aten._weight_int8pack_mm(kernel_rows(rows), self.codes, self.scales)
        return self.dequantized_product(rows)

    def dequantized(self, dtype: torch.dtype = PRODUCT_DTYPE, first: int = 0, last: int | None = None) -> torch.Tensor:
        return self.codes[first:last].to(dtype).mul_(self.scales[first:last].to(dtype)[:, None])  # [rows, in]


class Int4Linear(WeightOnlyLinear):
    """Weight-only int4 in groups of input channels (:func:`int4_fits` says which shapes take it).

    On a CPU the codes live only in the kernel's packed layout, which every row count goes through;
    elsewhere two codes share a byte (low nibble first) and the weight is dequantized for each
    product. The kernel needs torch 2.6 or newer."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 nibbles: bool = False):
        """codes [out, in] in 0..15, scales and zeros [out, in / INT4_GROUP] (:func:`dequantize_int4`);
        ``nibbles``: keep two codes a byte even on a CPU (what other devices hold; for tests)."""
        super().__init__(codes.shape[1], codes.shape[0], bias)
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], -1).transpose(0, 1)
                             .contiguous().to(PRODUCT_DTYPE))  # [G, out, 2], as the kernel takes them
        if codes.device.type == "cpu" and not nibbles:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            self.register_buffer("packed", packed)  # [out, in/2] uint8, the kernel's layout
            self.nibbles = None
        else:
            self.register_buffer("nibbles", pack_nibbles(codes))  # [out, in/2] uint8
            self.packed = None

    @classmethod
    def quantized(cls, weight: torch.Tensor, bias: torch.Tensor | None, nibbles: bool = False) -> Int4Linear:
        """``weight`` [out, in] quantized to int4 (:func:`quantize_int4`)."""
        return cls(*by_row_blocks(quantize_int4, weight, INT4_GROUP), bias, nibbles)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(kernel_rows(rows), self.packed, INT4_GROUP,
                                                              self.scales_and_zeros)
        return self.dequantized_product(rows)

    def dequantized(self, dtype: torch.dtype = PRODUCT_DTYPE, first: int = 0, last: int | None = None) -> torch.Tensor:
        """From the nibbles; from the CPU kernel's packed layout, which has no reader, as the
        kernel's product with the identity (in x in x out multiply-adds: for occasional use)."""
        if self.packed is not None:
            return self.product(torch.eye(self.in_features, dtype=PRODUCT_DTYPE)).T[first:last].to(dtype)  # [rows, in]
        codes = unpack_nibbles(self.nibbles[first:last])  # [rows, in]
        scales, zeros = self.scales_and_zeros[:, first:last].to(dtype).transpose(0, 1).unbind(-1)  # [rows, G] each
        return dequantize_int4(codes, scales, zeros)  # [rows, in]


def stored_bytes(out_features: int, in_features: int, weights: str) -> int:
    """Bytes of a linear layer's weight stored in ``weights`` (a dtype's name, int8 or int4), as
    :func:`stored_linear` stores it."""
    if weights == "int4" and int4_fits(in_features, out_features):
        groups = out_features * (in_features // INT4_GROUP)
        return out_features * in_features // 2 + groups * 2 * PRODUCT_DTYPE.itemsize
    if weights in ("int8", "int4"):
        return out_features * in_features + out_features * PRODUCT_DTYPE.itemsize
    return out_features * in_features * getattr(torch, weights).itemsize


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight [out, in], whichever form stores it (dequantized where it is)."""
    return layer.dequantized() if isinstance(layer, WeightOnlyLinear) else layer.weight


def stored_linear(layer: nn.Linear, weights: str, int4_codes: tuple | None = None) -> nn.Module:
    """``layer`` with its weight stored in ``weights`` (bfloat16, int8 or int4; an int4 layer of a
    shape the kernel cannot take is stored in int8); ``int4_codes``: the int4 form the checkpoint
    itself holds (packed codes :func:`pack_nibbles`, scales, zeros: a GGUF's 4-bit blocks), taken
    instead of quantizing."""
    weight, bias = layer.weight.detach(), layer.bias
    if weights == "bfloat16":
        return BF16Linear(weight, bias)
    if weights == "int4" and int4_fits(layer.in_features, layer.out_features):
        if int4_codes is None:
            return Int4Linear.quantized(weight, bias)
        nibbles, scales, zeros = (t.to(weight.device) for t in int4_codes)
        codes = unpack_nibbles(nibbles)  # [out, in]
        if codes.shape != weight.shape:
            raise ValueError(f"int4 codes {tuple(codes.shape)} for a weight {tuple(weight.shape)}")
        return Int4Linear(codes, scales, zeros, bias)
    return Int8Linear(weight, bias)


def store_linears(module: nn.Module, weights: str, prefix: str = "",
                  int4_codes: dict[str, tuple] | None = None) -> nn.Module:
    """``module`` (named ``prefix`` in its model) with every linear layer in its ``weights`` form
    (bfloat16, int8 or int4): its own children replaced one layer at a time (each float weight is
    freed as its layer is replaced, so the conversion holds at most one converted layer beyond the
    model), or, where ``module`` is itself a linear layer, its stored form. Each layer is quantized
    in blocks of rows. ``int4_codes``: the checkpoint's own int4 form of some layers, by module
    name (:func:`icekv.model.gguf_blocks.load_int4_blocks`), consumed: each entry leaves the dict
    as its layer is stored, so its codes are freed with it."""
    if weights not in ("bfloat16", "int8", "int4"):  # EngineConfig.weights_on refuses these before a load
        raise ValueError(f"linear weights cannot be stored in {weights!r}")
    int4_codes = {} if int4_codes is None else int4_codes
    if isinstance(module, nn.Linear):
        return stored_linear(module, layer_format(prefix, weights), int4_codes.pop(prefix, None))
    places = [(parent, path, name) for path, parent in module.named_modules(prefix=prefix)
              for name, child in parent.named_children()
              if isinstance(child, nn.Linear)]  # no reference to the layers themselves: each is freed when replaced
    for parent, path, name in places:
        full_name = f"{path}.{name}" if path else name
        stored = stored_linear(getattr(parent, name), layer_format(full_name, weights), int4_codes.pop(full_name, None))
        setattr(parent, name, stored)
    return module


def store_weights(model: nn.Module, weights: str, compute_dtype: torch.dtype,
                  int4_codes: dict[str, tuple] | None = None) -> None:
    """Store ``model``'s linear layers in ``weights`` (:func:`store_linears`); weights stored in the
    compute dtype (``weights`` is that dtype's name) stay as they are. The tensors left in the
    compute dtype are then copied off a checkpoint mapped from its file (so that the mapping is let
    go), and the freed heap is handed back: a stored model holds about its stored bytes."""
    if not stored_apart(weights, str(compute_dtype).removeprefix("torch.")):
        return
    store_linears(model, weights, int4_codes=int4_codes)
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.dtype == compute_dtype and tensor.device.type == "cpu":  # embeddings, norms, biases: off
            tensor.data = tensor.data.clone()  # the checkpoint's file mapping, which the linear weights let go
    return_freed_heap()


def return_freed_heap() -> None:
    """Hand the heap that the conversion freed back to the operating system: glibc keeps freed
    blocks below its mmap threshold (each layer's temporaries) resident otherwise."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
