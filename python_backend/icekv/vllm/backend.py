"""vLLM's CPU attention backend with icekv's decode selection (imports vLLM: loaded by vLLM only).

Per step, the metadata builder (one per KV-cache group) finds the decode rows whose request
selects: a decoding request (one new token) under a sparse plan whose context outgrew its budget.
Its index (:class:`icekv.vllm.request_index.RequestIndex`) lives in the builder, keyed by vLLM's
request id, which the worker (:mod:`icekv.vllm.worker`) hands over with each step and uses to
release the indexes of finished, aborted, preempted and resumed requests. A released index is kept
(:class:`icekv.policies.index_cache.IndexCache`, keyed by the tokens it covers) for a request whose
tokens continue them: a conversation's next turn, or the preempted request itself, resumed. In the
layers the plan budgets, those rows attend sink + selected pages + window over vLLM's cache; every
other row, and every row in the other layers, goes through vLLM's own kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata, CPUAttentionMetadataBuilder)

from icekv.policies import PolicyPlan
from icekv.policies.index_cache import IndexCache
from icekv.vllm import settings
from icekv.vllm.request_index import BlockLayout, BlockRows, RequestIndex

LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class GlobalLayers:
    """The model's depth as a plan's layer rules read it: under icekv, vLLM runs no model with
    sliding-window layers (the backend refuses a window), so every layer is global."""

    num_layers: int

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))


@dataclass
class SelectingRow:
    row: int  # the batch row
    token: int  # its query token's index in the step
    index: RequestIndex
    length: int  # tokens in its cache, this step's included


@dataclass
class IceKVMetadata(CPUAttentionMetadata):
    selecting: list[SelectingRow] = field(default_factory=list)
    sparse_layers: frozenset[int] = frozenset()  # the layers where they select
    dense: CPUAttentionMetadata | None = None  # the other rows alone, for those layers
    dense_tokens: torch.Tensor | None = None  # [t]: their query tokens in the step
    layout: BlockLayout | None = None  # where rows sit in the cache's blocks


class IceKVCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend, named as it (the CPU platform asks for it by that name)."""

    @staticmethod
    def get_impl_cls():
        return IceKVImpl

    @staticmethod
    def get_builder_cls():
        return IceKVBuilder


def probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> BlockLayout:
    """Where vLLM's cache writer puts each (row, dim) of a block's K and V for this ISA: three rows
    of coded values (the row; the dim mod 64; the dim // 64: small integers, exact in any dtype)
    written through ``cpu_attn_reshape_and_cache`` into one scratch block, and read back."""
    tile = block_size * head_dim
    rows = torch.arange(block_size)[:, None].expand(block_size, head_dim)  # [bs, D]
    dims = torch.arange(head_dim)[None, :].expand(block_size, head_dim)  # [bs, D]
    found = []
    for code in (rows, dims % 64, dims // 64):
        cache = torch.full((1, 1, block_size, 2 * head_dim), -1, dtype=dtype)  # -1: never written
        halves = cache.view(1, 1, 2 * block_size, head_dim)
        kv = code[:, None, :].to(dtype)  # [bs, 1, D]
        ops.cpu_attn_reshape_and_cache(kv, kv, halves[:, :, :block_size], halves[:, :, block_size:],
                                       torch.arange(block_size), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        found.append(cache.view(-1).long())  # [2 * tile]: the code at each offset
    row, dim = found[0], found[1] + 64 * found[2]
    half = (torch.arange(2 * tile) >= tile).long()  # 0: K, 1: V
    slot = (half * block_size + row) * head_dim + dim  # each (half, row, dim) once, if the writer wrote every offset
    if (found[0] < 0).any() or not torch.equal(slot.sort().values, torch.arange(2 * tile)):
        raise RuntimeError(f"icekv cannot read vLLM's KV cache layout for ISA {isa} ({dtype}, block {block_size}, "
                           f"head dim {head_dim}): not every value landed once")
    offsets = torch.empty(2 * tile, dtype=torch.long)
    offsets[slot] = torch.arange(2 * tile)
    offsets = offsets.view(2, block_size, head_dim)
    return BlockLayout(offsets[0], offsets[1])


class IceKVBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.selection = settings.server_selection(vllm_config.additional_config)
        self.plans: dict[str, PolicyPlan] = {}  # vLLM request id -> its plan, resolved at its first step
        self.indexes: dict[str, RequestIndex] = {}  # vLLM request id -> its index, from its first selecting step
        self.runner = None  # the model runner, handed over by the worker: its batch rows' request ids
        self.selecting_steps = 0  # (request, step) pairs that selected, finished requests' too
        self.indexes_built = 0  # finished requests' too
        self.indexes_continued = 0  # requests that took over a released index instead of building one
        self.index_cache: IndexCache | None = None  # released indexes, for requests that continue their tokens
        if self.selection is None:  # vLLM's own backend, nothing more
            return
        if is_quantized_kv_cache(self.kv_cache_dtype):
            raise ValueError(f"icekv reads the KV cache's rows: a quantized kv_cache_dtype ({self.kv_cache_dtype}) "
                             "is not supported")
        if not vllm_config.parallel_config.worker_cls.startswith("icekv.vllm.worker."):
            raise ValueError("icekv's settings need its worker (it tells the backend which request each batch row "
                             "holds): start vLLM with --worker-cls icekv.vllm.worker.IceKVCPUWorker")
        self.layout = probe_layout(self.isa, self.dtype, self.block_size, self.head_dim)
        self.layers = GlobalLayers(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
        self.index_cache = IndexCache(vllm_config.model_config.model, settings.plan(self.selection).page_size)

    def release(self, request_ids) -> None:
        """Drop the plans and indexes of requests that ended or lost their blocks, keeping each
        index that a request continuing its tokens may take over (:meth:`_keep`)."""
        for request_id in request_ids:
            self.plans.pop(request_id, None)
            index = self.indexes.pop(request_id, None)
            if index is not None:
                self._keep(request_id, index)
        if self.index_cache:  # checked at each step's start: an index built in a step may pass it till the next
            self.index_cache.trim(self.kept_limit())

    def kept_limit(self) -> int:
        """Host bytes the kept indexes may hold: what the live requests' indexes leave of the size of
        vLLM's KV cache (the rule of icekv's own engine, whose indexes live and kept take at most its
        pool's size)."""
        live = sum(index.selector.index_bytes() for index in self.indexes.values())
        return sum(t.nbytes for t in self.runner.kv_caches) - live

    def _keep(self, request_id: str, index: RequestIndex) -> None:
        """Keep a released index whose plan grows its index by insertion (the others carry a
        request's own decode state) and whose every budgeted layer ends its region at one place."""
        covered = index.covered(len(index.plan.sparse_layers(self.layers)))
        if covered is not None and index.plan.extends_index:
            self.index_cache.keep(self._token_ids(request_id), covered, index.plan, index.selector)

    def _token_ids(self, request_id: str) -> list[int]:
        """The request's tokens as the runner knows them, prompt and output: what keys its index.
        None known for a prompt of embeddings, a LoRA adapter's or a multimodal request (their keys
        differ for the same ids); only up to the first placeholder of vLLM's asynchronous scheduling
        (which vLLM's CPU platform turns off), so a region past it is not kept."""
        state = self.runner.requests.get(request_id)
        if state is None or state.prompt_token_ids is None or state.lora_request is not None or state.mm_features:
            return []
        ids = state.prompt_token_ids + state.output_token_ids
        return ids[:ids.index(-1)] if -1 in ids else ids

    def _index(self, request_id: str, length: int) -> RequestIndex | None:
        """The request's index, made (or continued from a released one) at its first selecting step;
        None while it does not select."""
        index = self.indexes.get(request_id)
        if index is None:
            plan = self.plans.get(request_id)
            if plan is None:  # its settings were checked at admission (icekv.vllm.validation)
                state = self.runner.requests[request_id]
                extra = state.sampling_params.extra_args if state.sampling_params is not None else None
                plan = self.plans[request_id] = settings.plan(settings.request_selection(self.selection, extra))
            if not plan.selects(length):
                return None
            continued = None
            if self.index_cache and plan.extends_index:
                region_end = plan.window_start(plan.sink_tokens, length)
                continued = self.index_cache.take(self._token_ids(request_id), region_end, plan)
            index = self.indexes[request_id] = RequestIndex(plan, continued)
            if continued is None:
                self.indexes_built += 1
            else:
                self.indexes_continued += 1
        return index

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.selection is None or self.runner is None:  # vLLM's own; or a warm-up, before the worker's first step
            return metadata
        starts = common_attn_metadata.query_start_loc_cpu.tolist()
        lengths = common_attn_metadata.seq_lens.cpu().tolist()
        request_ids = self.runner.input_batch.req_ids[: common_attn_metadata.num_reqs]
        selecting = []
        for row, request_id in enumerate(request_ids):
            if starts[row + 1] - starts[row] == 1 and (index := self._index(request_id, lengths[row])):
                selecting.append(SelectingRow(row, starts[row], index, lengths[row]))
        out = IceKVMetadata(**{f.name: getattr(metadata, f.name) for f in fields(CPUAttentionMetadata)},
                            selecting=selecting, layout=self.layout)
        if selecting:
            self.selecting_steps += len(selecting)
            out.sparse_layers = frozenset(selecting[0].index.plan.sparse_layers(self.layers))
            out.dense, out.dense_tokens = self._dense(metadata, starts, lengths, {s.row for s in selecting})
        return out

    def _dense(self, metadata: CPUAttentionMetadata, starts: list[int], lengths: list[int], selecting: set[int]):
        """The metadata of the rows that do not select, alone; None where there are none."""
        rows = [r for r in range(len(lengths)) if r not in selecting]
        if not rows:
            return None, None
        tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])  # [t]
        query_lens = torch.tensor([starts[r + 1] - starts[r] for r in rows])
        query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start_loc[1:] = query_lens.cumsum(0)
        seq_lens = torch.tensor([lengths[r] for r in rows], dtype=torch.int32)
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            seq_lens=seq_lens, dtype=self.dtype, query_start_loc=query_start_loc, causal=metadata.causal,
            sliding_window_size=self.window_size, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        dense = CPUAttentionMetadata(
            num_actual_tokens=len(tokens), max_query_len=int(query_lens.max()), query_start_loc=query_start_loc,
            max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=metadata.block_table[rows].contiguous(),
            slot_mapping=metadata.slot_mapping[tokens], scheduler_metadata=scheduler_metadata, causal=metadata.causal)
        return dense, tokens


class IceKVImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        if settings.server_selection(get_current_vllm_config().additional_config) is not None:
            unsupported = [name for name, given in (("a sliding window", self.sliding_window != -1),
                                                    ("ALiBi", self.alibi_slopes is not None),
                                                    ("a logits soft cap", bool(self.logits_soft_cap)),
                                                    ("attention sinks", self.sinks is not None)) if given]
            if unsupported:
                raise ValueError(f"icekv's sparse attention does not apply {', '.join(unsupported)}: this model "
                                 "runs on vLLM's own backend (drop the icekv settings)")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not isinstance(attn_metadata, IceKVMetadata) or not attn_metadata.selecting:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        layer_id = int(LAYER.search(layer.layer_name).group(1))
        if layer_id not in attn_metadata.sparse_layers:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        heads = query.shape[1]
        out = output.view(output.shape[0], heads, -1)  # [T, Hq, D]
        if attn_metadata.dense is not None:
            tokens = attn_metadata.dense_tokens
            dense_out = torch.empty_like(out[tokens])  # [t, Hq, D]
            super().forward(layer, query[tokens].contiguous(), key, value, kv_cache, attn_metadata.dense, dense_out)
            out[tokens] = dense_out
        for s in attn_metadata.selecting:
            rows = BlockRows(kv_cache, attn_metadata.block_table[s.row], attn_metadata.layout)
            out[s.token] = s.index.attend(layer_id, query[s.token], rows, s.length, self.scale)
        return output
