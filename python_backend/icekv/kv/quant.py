"""Quantized KV rows: what the page pool, the device slots and stored contexts hold per token.

With ``kv_dtype`` ``int8`` or ``fp8_e4m3`` each token's K (or V) of one KV head is one *packed
row* of ``head_dim + 4`` bytes: ``head_dim`` codes, then its scale as a float32 (absmax / the
format's largest code). The scale is per token and KV head, not per page, because icekv moves
single tokens between pages: a selection's virtual pages, a compressed context's kept tokens
regrouped per head, a prefix page copied on write and a decode token appended to a half-filled
page all carry their scale along as plain bytes, with nothing to re-quantize. Every copy of rows
(the pool, the slots, staging buffers, gathers) is then dtype-blind; only attention and the
readers that compute with K/V decode them (:meth:`KVFormat.unpack`, or the kernels themselves:
the GPU kernel through a code table, the CPU loops through fp16 bits). ``auto`` stores the model's dtype, unpacked: every method is then the identity.

Keys are quantized after RoPE (the pool holds what attention reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.config.paging import KV_DTYPES

SCALE_BYTES = 4  # one float32 scale after each row's codes
_LARGEST = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass(frozen=True)
class KVFormat:
    """How one token's K or V row [head_dim] is stored: ``auto`` (the model dtype) or packed codes
    plus a float32 scale."""

    name: str = "auto"

    def __post_init__(self):
        if self.name not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.name!r}")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8 if self.quantized else model_dtype

    def row_width(self, head_dim: int) -> int:
        """Elements of one stored row: ``head_dim``, or its codes and the scale's 4 bytes."""
        if not self.quantized:
            return head_dim
        if head_dim % SCALE_BYTES:
            raise ValueError(f"a quantized KV pool needs head_dim divisible by {SCALE_BYTES}, got {head_dim}")
        return head_dim + SCALE_BYTES

    def head_dim(self, row_width: int) -> int:
        return row_width - SCALE_BYTES if self.quantized else row_width

    def row_bytes(self, head_dim: int, model_dtype_bytes: int) -> int:
        """Bytes one token's K (or V) of one KV head takes, for a model dtype of
        ``model_dtype_bytes`` bytes per element."""
        return self.row_width(head_dim) * (1 if self.quantized else model_dtype_bytes)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (any float dtype) -> stored rows [..., W]."""
        if not self.quantized:
            return x
        x = x.float()
        absmax = x.abs().amax(-1, keepdim=True)  # [..., 1]
        scale = torch.where(absmax > 0, absmax / _LARGEST[self.name], 1.0)  # [..., 1] fp32
        scaled = x / scale
        if self.name == "int8":
            codes = scaled.round().clamp(-127, 127).to(torch.int8)  # [..., D]
        else:
            codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.int8)  # [..., D]
        return torch.cat([codes, scale.view(torch.int8)], -1)  # [..., D + 4]

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., W] -> values [..., D] in ``dtype`` (``rows`` itself when not quantized)."""
        if not self.quantized:
            return rows
        return (self.codes(rows) * self.scales(rows)).to(dtype)  # [..., D]

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """Values x [..., D] as storing and reading them back gives them (x itself when not
        quantized): for copies kept beside the pool, so a token reads the same from either."""
        return self.unpack(self.pack(x), x.dtype) if self.quantized else x

    def codes(self, rows: torch.Tensor) -> torch.Tensor:
        """The code values of rows [..., W], as float32 [..., D] (unscaled)."""
        codes = rows[..., : rows.shape[-1] - SCALE_BYTES]
        return (codes if self.name == "int8" else codes.view(torch.float8_e4m3fn)).float()

    @staticmethod
    def scales(rows: torch.Tensor) -> torch.Tensor:
        """Each row's scale [..., 1] float32, a view of rows [..., W] (no copy on a contiguous pool)."""
        tail = rows[..., rows.shape[-1] - SCALE_BYTES:]
        return tail.view(torch.float32) if tail.stride(-1) == 1 else tail.contiguous().view(torch.float32)

    def lut(self) -> torch.Tensor | None:
        """[256] float32: the value of each code byte (read as an unsigned byte), for kernels that
        decode fp8 codes by table lookup (the OpenAI-Triton decode); None where a code converts
        directly (int8) or there are no codes (auto)."""
        if self.name != "fp8_e4m3":
            return None
        byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
        return byte.view(torch.float8_e4m3fn).float()


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """Packed rows [..., W] int8 viewed as float32 words [..., W / 4] (the scale is word D / 4): how
    kernels read each row's scale without a copy."""
    return rows.view(torch.float32)
