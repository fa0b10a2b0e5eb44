"""Plain-torch references of every kernel: the specification the kernels are tested against, and
the implementation used wherever the kernels cannot run (CPU, no triton).

Shared data contract (all tensors contiguous):
  q          [B, Hq, D]       one decode query per sequence; query head h reads KV head h // (Hq/Hkv)
  k/v_pages  [Hkv, S, P, W]   a page pool: S page slots per KV head; rows of W = D elements in the
                              model dtype, or (quantized KV) packed int8 rows of W = D + 4, decoded
                              by the ``kv_format`` argument (:mod:`icekv.kv.quant`)
  page_ids   [B, Hkv, K] i32  slots to read per (sequence, KV head); -1 = no page
  page_lens  [B, Hkv, K] i32  valid tokens of each named page (0 = skip it)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from icekv.kv.quant import KVFormat


def _gather(pages: torch.Tensor, page_ids: torch.Tensor, page_lens: torch.Tensor):
    """Named pages per (sequence, KV head) and their token mask: [B, Hkv, K, P, W], [B, Hkv, K, P]."""
    hkv, _, page_size, _ = pages.shape
    heads = torch.arange(hkv, device=pages.device)[None, :, None]  # [1, Hkv, 1]
    ids = page_ids.long()
    picked = pages[heads, ids.clamp(min=0)]  # [B, Hkv, K, P, W]
    lens = torch.where(ids >= 0, page_lens.long().clamp(max=page_size), 0)  # [B, Hkv, K]
    mask = torch.arange(page_size, device=pages.device) < lens[..., None]  # [B, Hkv, K, P]
    return picked, mask


def sparse_decode_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            page_ids: torch.Tensor, page_lens: torch.Tensor,
                            sm_scale: float | None = None,
                            kv_format: KVFormat = KVFormat()) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over the tokens of its KV head's named pages (stored in
    ``kv_format``, decoded to fp32 after the gather).

    Returns out [B, Hq, D] in q's dtype and lse [B, Hq] (fp32 log-sum-exp of the scaled scores,
    so partial results can be merged). A query with no valid token gets out = 0, lse = -inf.
    """
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    scale = d**-0.5 if sm_scale is None else sm_scale
    keys, mask = _gather(k_pages, page_ids, page_lens)
    values, _ = _gather(v_pages, page_ids, page_lens)
    decode = lambda x: kv_format.unpack(x.flatten(2, 3), torch.float32).float()  # [B, Hkv, K*P, D]
    keys, values = decode(keys), decode(values)
    mask = mask.flatten(2)  # [B, Hkv, K*P]
    qg = q.float().view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, keys) * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # [B, Hkv, G, T]
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # 0 where empty
    out = torch.einsum("bhgt,bhtd->bhgd", probs, values)
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)


def page_scores_reference(q: torch.Tensor, k_pages: torch.Tensor, cand_ids: torch.Tensor,
                          cand_lens: torch.Tensor) -> torch.Tensor:
    """Score of each candidate page = its best q.k over the KV head's query heads and the page's
    valid tokens (IceCache's page score, shared by a GQA group). [B, Hkv, C] fp32, -inf if empty."""
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    keys, mask = _gather(k_pages, cand_ids, cand_lens)  # [B, Hkv, C, P, D]
    qg = q.float().view(b, hkv, hq // hkv, d)
    dots = torch.einsum("bhgd,bhcpd->bhgcp", qg, keys.float())
    dots = dots.masked_fill(~mask[:, :, None], float("-inf"))
    return dots.amax(dim=(2, 4))  # [B, Hkv, C]


def topk_reference(scores: torch.Tensor, cand_ids: torch.Tensor, cand_lens: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and valid lengths of the ``k`` best-scoring candidates per row, best first (ties: earlier
    candidate first); -1 / 0 where fewer than ``k`` have a finite score. Both [B, Hkv, k] int32."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]  # [B, Hkv, k']
    found = torch.isfinite(scores.gather(-1, order))
    ids = torch.where(found, cand_ids.gather(-1, order), -1)
    lens = torch.where(found, cand_lens.gather(-1, order), 0)
    pad = (0, k - ids.shape[-1])
    return F.pad(ids, pad, value=-1).to(torch.int32), F.pad(lens, pad, value=0).to(torch.int32)


def page_select_reference(q, k_pages, cand_ids, cand_lens, k: int):
    """Top-``k`` candidate pages per (sequence, KV head) by best q.k:
    (ids [B, Hkv, k] i32, lens [B, Hkv, k] i32, scores [B, Hkv, C] fp32)."""
    scores = page_scores_reference(q, k_pages, cand_ids, cand_lens)
    return (*topk_reference(scores, cand_ids, cand_lens, k), scores)


def scatter_pages_reference(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor,
                            src_v: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor) -> None:
    """In place: dst_k/v [Hkv, S, P, D][heads[i], slots[i]] = src_k/v [n, P, D][i]."""
    dst_k[heads.long(), slots.long()] = src_k.to(dst_k.dtype)
    dst_v[heads.long(), slots.long()] = src_v.to(dst_v.dtype)


def paged_decode_reference(q: torch.Tensor, pool_layer: torch.Tensor, page_ids: torch.Tensor, starts: torch.Tensor,
                           lengths: torch.Tensor, kv_format: KVFormat = KVFormat(),
                           first_visible: torch.Tensor | None = None) -> torch.Tensor:
    """Full decode attention of each request over its pages in the pool: q [B, Hq, D], pool_layer
    [2, Hkv, pool pages, P, W] rows in ``kv_format`` (quantized: decoded to fp32, the result cast
    to q's dtype), page_ids [total pages], starts [B], lengths [B] -> [B, Hq, D]. With
    ``first_visible`` [B] (a sliding window's first position, < lengths; host tensors like starts
    and lengths), request ``b`` attends positions ``first_visible[b] .. lengths[b]-1`` only, reading
    only their pages."""
    _, hkv, _, page_size, _ = pool_layer.shape
    d = q.shape[-1]
    out = []
    for i in range(q.shape[0]):
        n, first = int(lengths[i]), int(starts[i])
        seen = int(first_visible[i]) if first_visible is not None else 0  # the first position attended
        offset = seen // page_size * page_size  # the first position of its page
        pages = page_ids[first + offset // page_size : first + -(-n // page_size)].long()  # [pages]
        kv = pool_layer[:, :, pages].flatten(2, 3)[:, :, seen - offset : n - offset]  # [2, Hkv, n-seen, W]
        kv = kv_format.unpack(kv, torch.float32)  # [2, Hkv, n-seen, D]
        scores = torch.matmul(q[i].to(kv.dtype).view(hkv, -1, d), kv[0].transpose(1, 2)) * d**-0.5  # [Hkv, G, n-seen]
        out.append(torch.matmul(scores.softmax(-1), kv[1]).reshape(q.shape[1:]).to(q.dtype))  # [Hq, D]
    return torch.stack(out)
