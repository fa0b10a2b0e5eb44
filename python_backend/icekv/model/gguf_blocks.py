"""A GGUF's own 4-bit weights in icekv's int4 layout, so that ``--weights int4`` keeps them.

GGUF's Q4_0, Q4_1 and Q4_K tensors hold a 4-bit code per weight and, per 32 consecutive inputs,
a scale and an offset: the form of icekv's int4 (``(code - 8) * scale + zero`` per group of 32
input channels, :func:`icekv.model.weights.dequantize_int4`). A model converted from such a GGUF
holds those weights dequantized; quantizing them to int4 again would round them a second time,
onto another grid. So the conversion (:mod:`icekv.convert`) also writes each 4-bit linear
weight's codes, scales and zeros (:data:`BLOCKS_FILE`), once they reproduce the weight that
transformers dequantized, and the int4 format loads them instead of quantizing.

Other GGUF types (Q6_K, Q8_0, ...) have no int4 form: those layers are quantized from the weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from icekv.model.weights import INT4_GROUP, dequantize_int4, pack_nibbles

log = logging.getLogger(__name__)

BLOCKS_FILE = "gguf-int4/blocks.safetensors"  # in a model folder; a subfolder: not one of its weight files
PERMUTED_QK = ("llama",)  # architectures whose q and k rows llama.cpp's converter interleaved (Mistral's too)


def decode_blocks(data: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's raw blocks (``kind`` Q4_0, Q4_1 or Q4_K; its rows' bytes, any shape) of ``shape``
    (out, in) -> codes [out, in] uint8 in 0..15, scales and zeros [out, in / 32] float32, with
    ``(codes - 8) * scale + zero`` the values the type stands for."""
    out_features, in_features = shape
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4  # d, and Q4_1's m: float16 each
        blocks = raw.reshape(-1, head + INT4_GROUP // 2)  # [n, bytes]
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        qs = blocks[:, head:]  # [n, 16]: inputs 0-15 in the low nibbles, 16-31 in the high ones
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)  # [n, 32]
        scales = d
        # Q4_0: d * (q - 8); Q4_1: d * q + m = (q - 8) * d + (m + 8 d)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if kind == "Q4_1" else None  # [n, 1]
        zeros = np.zeros_like(d) if m is None else m + 8 * d
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)  # [n, bytes]: 256 inputs, 8 groups of 32
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1]
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] 6-bit each
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # [n, 4, 1, 32]: group 2j in the low nibbles, 2j + 1 the high
        codes = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256)  # [n, 256]
        scales = d * sc.astype(np.float32)  # [n, 8]: d * sc * q - dmin * m = (q - 8) * s + (8 s - dmin * m)
        zeros = 8 * scales - dmin * mins.astype(np.float32)
    else:
        raise ValueError(f"GGUF type {kind} has no int4 form (Q4_0, Q4_1 and Q4_K have)")
    groups = in_features // INT4_GROUP
    return (codes.reshape(out_features, in_features), scales.reshape(out_features, groups),
            zeros.reshape(out_features, groups))


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo the interleaving llama.cpp's converter applies to a Llama q or k weight's rows (per head,
    the two halves of the rotary dimensions), on any array whose first axis is those rows."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def gguf_int4_blocks(gguf: Path, state: dict[str, torch.Tensor], architecture: str, heads: int,
                     kv_heads: int) -> dict[str, torch.Tensor]:
    """The 4-bit linear weights of the GGUF file ``gguf`` as int4 codes (two a byte, the low
    nibble first), scales and zeros, keyed ``<weight name>.codes|scales|zeros`` by the names of
    ``state`` (the model transformers converted from it). A weight is kept only where its blocks
    reproduce ``state``'s weight (a mapping that does not is logged and skipped, never used)."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    reader = GGUFReader(gguf)
    tensors = {t.name: t for t in reader.tensors}
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == architecture), None)
    if arch is None:
        return {}
    layers = 1 + max((int(n.split(".")[1]) for n in tensors if n.startswith("blk.")), default=-1)
    names = get_tensor_name_map(arch, layers)
    blocks: dict[str, torch.Tensor] = {}
    for name, weight in state.items():
        gguf_name = names.get_name(name.removesuffix(".weight")) if name.endswith(".weight") else None
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name is not None else None
        if tensor is None or weight.dim() != 2 or tensor.tensor_type.name not in ("Q4_0", "Q4_1", "Q4_K"):
            continue
        codes, scales, zeros = decode_blocks(tensor.data, tensor.tensor_type.name, tuple(weight.shape))
        if architecture in PERMUTED_QK and gguf_name.endswith(("attn_q", "attn_k")):
            count = heads if gguf_name.endswith("attn_q") else kv_heads
            codes, scales, zeros = (unpermute_rows(a, count) for a in (codes, scales, zeros))
        codes, scales, zeros = (torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scales, zeros))
        expected = weight.float()
        tolerance = 1e-6 * float(expected.abs().max())
        if not torch.allclose(dequantize_int4(codes, scales, zeros), expected, rtol=1e-5, atol=tolerance):
            log.warning("GGUF tensor %s does not reproduce %s: its 4-bit blocks are not kept", tensor.name, name)
            continue
        blocks[f"{name}.codes"] = pack_nibbles(codes)  # [out, in / 2]
        blocks[f"{name}.scales"], blocks[f"{name}.zeros"] = scales, zeros
    return blocks


def load_int4_blocks(model_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A converted GGUF's 4-bit weights in ``model_dir`` by module name (as the decoder names its
    layers: ``layers.0.self_attn.q_proj``): codes two a byte [out, in / 2] uint8
    (:func:`icekv.model.weights.pack_nibbles`), scales and zeros [out, in / 32] float32. Empty for
    a folder without them (one converted before they were kept: delete it to convert it again)."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    from safetensors.torch import load_file

    flat = load_file(str(path))
    found = {}
    for key in flat:
        if key.endswith(".codes"):
            stem = key.removesuffix(".codes")
            module = stem.removesuffix(".weight").removeprefix("model.")
            found[module] = (flat[key], flat[f"{stem}.scales"], flat[f"{stem}.zeros"])
    return found
