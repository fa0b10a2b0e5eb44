"""Admission and memory plan of ``icekv bench decode | batch``, computed before anything loads.

A benchmark sizes its own limits for what it runs: the page pool for its largest wave (every
request of the largest batch at the longest context, plus the real prefill its caches are tiled
from), the device bytes its requests hold beside the model (when the pool is off the compute
device) for the wave that holds most, and ``max_active_requests`` for the largest batch. The index limit
stays the engine's rule, the pool's size: an index must not outweigh the KV it indexes.

For every (policy, context, batch) the plan then charges each request what the engine's admission
charges it (:meth:`icekv.policies.PolicyPlan.index_bytes`, :func:`icekv.sizing.device_need`, its pages) and
says whether the batch is admitted in one wave, with the numbers where it is not; and per policy
group (one engine per pool placement) the peak host and device memory it holds, against the
machine's. A wave refused here is refused before any prefill, where it costs nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.paging import PagingConfig
from icekv.kv.quant import KVFormat
from icekv.model import ModelArgs
from icekv.policies import PolicyPlan
from icekv.sizing import DTYPE_BYTES, device_need

# allowances, not measurements: what the process holds besides the plan's tensors
HOST_RUNTIME_BYTES = 4 << 30  # the interpreter, torch and the CUDA libraries
DEVICE_RUNTIME_BYTES = 2 << 30  # the CUDA context, allocator slack, one step's activations
STEP_TOKENS = 512  # prompt tokens per engine step beside the batch's decodes (SchedulerConfig)
GIB = 2**30


@dataclass(frozen=True)
class BenchRun:
    """What one benchmark runs: per (context, batch), ``batch`` requests whose caches hold
    ``context`` tokens (tiled from a real prefill of ``seed_tokens``) decode ``max_tokens`` each
    under every policy of ``plans``; ``groups``: (pool placement, policies) per engine, in
    order; ``peer_kv``: the first group also copies each context's KV once more onto the compute
    device (transformers' own cache, ``--peer hf``)."""

    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    plans: dict[str, PolicyPlan]
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    max_tokens: int
    seed_tokens: int = 1024
    peer_kv: bool = False


@dataclass(frozen=True)
class Machine:
    """Where it runs: the compute device's type and the memory of the host and of the device
    (on a CPU the two are one: ``device_bytes`` is ignored)."""

    device_type: str
    host_bytes: int
    device_bytes: int | None = None


@dataclass(frozen=True)
class Wave:
    """One (policy, context, batch): what admission charges and whether it takes it in one wave."""

    policy: str
    context: int
    batch: int
    pool: str  # the group's pool placement: host | device
    pages: int  # every request of the wave, worst case
    index_bytes: int  # the wave's page indexes, host
    index_share: float  # the wave's page indexes over the pool's bytes (admission allows up to 1)
    device_charge: int  # device bytes admission charges the wave (pool off the compute device)
    device_hold: int  # device bytes the wave's decodes hold
    refusals: tuple[str, ...] = ()

    @property
    def admitted(self) -> bool:
        return not self.refusals


@dataclass(frozen=True)
class GroupMemory:
    """Peak memory of one engine (one pool placement) over its waves."""

    pool: str
    policies: tuple[str, ...]
    host_bytes: int
    device_bytes: int


@dataclass(frozen=True)
class BenchPlan:
    paging: PagingConfig
    scheduler: SchedulerConfig
    pool_bytes: int
    weights_bytes: int
    waves: tuple[Wave, ...]
    groups: tuple[GroupMemory, ...]
    machine: Machine
    refusals: tuple[str, ...] = field(default=())  # the machine's: memory it lacks

    @property
    def admitted(self) -> bool:
        return not self.refusals and all(w.admitted for w in self.waves)

    def problems(self) -> list[str]:
        """Every reason the run cannot go as planned, with its numbers."""
        return [f"{w.policy} {w.batch} x {w.context}: {why}" for w in self.waves for why in w.refusals] \
            + list(self.refusals)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["admitted"] = self.admitted
        return out

    def lines(self) -> list[str]:
        """The plan for people: each wave, each group's memory against the machine."""
        gib = lambda b: f"{b / GIB:,.1f} GiB" if b >= GIB / 4 else f"{b / 2**20:,.1f} MiB"  # noqa: E731
        device = "" if self.machine.device_bytes is None else f", device {gib(self.machine.device_bytes)}"
        out = [f"pool {self.paging.pool_tokens:,} tokens ({gib(self.pool_bytes)}), weights "
               f"{gib(self.weights_bytes)}, max_active_requests {self.scheduler.max_active_requests}, max_device_bytes "
               f"{'-' if self.scheduler.max_device_bytes is None else gib(self.scheduler.max_device_bytes)}; "
               f"machine: {self.machine.device_type}, host {gib(self.machine.host_bytes)}{device}"]
        for w in self.waves:
            verdict = "one wave" if w.admitted else "REFUSED: " + "; ".join(w.refusals)
            out.append(f"{w.policy} {w.batch} x {w.context} (pool on the {w.pool}): index {gib(w.index_bytes)} "
                       f"({w.index_share:.0%} of the pool), device charged {gib(w.device_charge)}, held "
                       f"{gib(w.device_hold)}: {verdict}")
        for g in self.groups:
            out.append(f"{'+'.join(g.policies)} (pool on the {g.pool}): peak host {gib(g.host_bytes)}, "
                       f"peak device {gib(g.device_bytes)}")
        out += [f"REFUSED: {why}" for why in self.refusals]
        return out


def model_bytes(args: ModelArgs, dtype: str, weights: str = "auto") -> int:
    """The model's parameters in ``dtype``, its linear weights stored as ``weights`` (auto: in
    ``dtype``), counted on the meta device (nothing allocated). A tied output layer stored in
    another format is a copy beside the embedding."""
    import torch

    from icekv.model.llama import Decoder
    from icekv.model.weights import layer_format, stored_apart, stored_bytes

    with torch.device("meta"):
        model = Decoder(args)
    if not stored_apart(weights, dtype):
        return sum(p.numel() for p in model.parameters()) * DTYPE_BYTES[dtype]
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    rest = sum(p.numel() for name, p in model.named_parameters(remove_duplicate=False)
               if name.removesuffix(".weight") not in linears)
    return rest * DTYPE_BYTES[dtype] + sum(stored_bytes(m.out_features, m.in_features, layer_format(name, weights))
                                           for name, m in linears.items())


def plan_bench(args: ModelArgs, dtype: str, run: BenchRun, machine: Machine, kv_dtype: str = "auto",
               weights: str = "auto") -> BenchPlan:
    """The limits ``run`` needs on ``machine`` and, per wave, whether the engine admits it at once;
    the pool stores K/V as ``kv_dtype``, the linear layers their weights as ``weights``."""
    page = next(iter(run.plans.values())).page_size
    pages_of = lambda tokens: math.ceil(tokens / page)  # noqa: E731
    largest = max(run.batches) * pages_of(max(run.contexts) + run.max_tokens)
    pool_pages = max(largest, pages_of(max(run.contexts)) + pages_of(run.seed_tokens)) + 1  # + the seed's prefill
    paging = PagingConfig(page_size=page, pool_tokens=pool_pages * page, kv_dtype=kv_dtype)
    token_bytes = 2 * args.num_kv_heads * args.head_dim * DTYPE_BYTES[dtype]  # one token, one layer, as values
    stored_bytes = 2 * args.num_kv_heads * KVFormat(kv_dtype).row_bytes(args.head_dim, DTYPE_BYTES[dtype])
    pool_bytes = pool_pages * page * stored_bytes * args.num_layers
    index_limit = pool_pages * page * token_bytes * args.num_layers  # the engine's default max_index_bytes: the pool's size as values
    waves = []
    for pool, policies in run.groups:
        for policy in policies:
            for context in run.contexts:
                for batch in run.batches:
                    waves.append(_wave(args, dtype, run, policy, context, batch, pool, pages_of, token_bytes,
                                       pool_pages, index_limit, machine.device_type))
    charged = [w.device_charge for w in waves if w.pool == "host"]
    device_limit = max(charged) if charged and machine.device_type != "cpu" else None
    batch = max(run.batches)
    scheduler = SchedulerConfig(max_active_requests=batch, max_step_tokens=batch + STEP_TOKENS, max_device_bytes=device_limit)
    weights_bytes = model_bytes(args, dtype, weights)
    groups = tuple(_group_memory(pool, policies, [w for w in waves if w.policy in policies], run, machine,
                                 weights_bytes, pool_bytes, token_bytes * args.num_layers, i == 0)
                   for i, (pool, policies) in enumerate(run.groups))
    refusals = []
    for g in groups:
        if g.host_bytes > machine.host_bytes:
            refusals.append(f"{'+'.join(g.policies)} needs {g.host_bytes / GIB:,.1f} GiB of host memory, the "
                            f"machine has {machine.host_bytes / GIB:,.1f} GiB")
        if machine.device_bytes is not None and machine.device_type != "cpu" and g.device_bytes > machine.device_bytes:
            refusals.append(f"{'+'.join(g.policies)} needs {g.device_bytes / GIB:,.1f} GiB of device memory, the "
                            f"device has {machine.device_bytes / GIB:,.1f} GiB")
    return BenchPlan(paging, scheduler, pool_bytes, weights_bytes, tuple(waves), groups, machine, tuple(refusals))


def _wave(args: ModelArgs, dtype: str, run: BenchRun, policy: str, context: int, batch: int, pool: str,
          pages_of, token_bytes: int, pool_pages: int, index_limit: int, device_type: str) -> Wave:
    """What the engine's admission charges ``batch`` prefilled requests of ``context`` tokens
    decoding ``run.max_tokens`` each (Engine.submit, Scheduler._fits)."""
    plan = run.plans[policy]
    held = context + run.max_tokens
    pages = batch * pages_of(held)
    one_index = plan.index_bytes(args, held, dtype) if plan.selects(held) else 0
    need = device_need(args, context, run.max_tokens, plan, token_bytes, 0, device_type,
                       chunk_tokens=EngineConfig.prefill_chunk_tokens)  # the engine's chunk
    off_device = pool == "host" and device_type != "cpu"
    # a prefilled request decodes at once: each running one is charged its decode, the newest its most
    charge = (batch - 1) * need.decode + need.most if off_device else 0
    hold = batch * need.decode if off_device else 0
    refusals = []
    if pages > pool_pages:
        refusals.append(f"{pages:,} pages, the pool has {pool_pages:,}")
    if batch * one_index > index_limit:
        refusals.append(f"page indexes of {batch * one_index / GIB:,.2f} GiB, above max_index_bytes "
                        f"({index_limit / GIB:,.2f} GiB, the pool's size): the index outweighs the KV it indexes "
                        f"({plan.selection.icecache.page_keys(dtype)} page keys over a {dtype} cache)")
    return Wave(policy, context, batch, pool, pages, batch * one_index, batch * one_index / index_limit,
                charge, hold, tuple(refusals))


def _group_memory(pool: str, policies: tuple[str, ...], waves: list[Wave], run: BenchRun, machine: Machine,
                  weights: int, pool_bytes: int, kv_token_bytes: int, first: bool) -> GroupMemory:
    """Peak host and device bytes of the engine that runs ``policies`` with its pool on ``pool``."""
    index = max((w.index_bytes for w in waves), default=0)
    hold = max((w.device_hold for w in waves), default=0)
    peer = max(run.contexts) * kv_token_bytes if first and run.peer_kv else 0  # transformers' copy of the KV
    if machine.device_type == "cpu":  # one memory
        return GroupMemory(pool, policies, HOST_RUNTIME_BYTES + weights + pool_bytes + index + peer, 0)
    host = HOST_RUNTIME_BYTES + index + (pool_bytes if pool == "host" else 0)
    device = DEVICE_RUNTIME_BYTES + weights + hold + peer + (pool_bytes if pool == "device" else 0)
    return GroupMemory(pool, policies, host, device)
