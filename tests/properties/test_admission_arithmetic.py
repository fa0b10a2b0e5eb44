"""Properties of admission (:class:`icekv.engine.scheduler.Scheduler` asking
:class:`icekv.engine.kv_manager.KVCacheManager`), over a pool and requests made of numbers only:
whatever arrives when, the running requests' worst cases never add up past the pool's pages, the
index and context memory or the device memory, so a running request never finds its next page
taken; and every request that fits alone in an empty pool is admitted once those before it finish,
in the order it came (no starvation). A request's charge covers its tokens and no more, and one
the engine lets in (``check_fits``) fits the empty pool."""

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from icekv.config.engine import SchedulerConfig
from icekv.engine import Engine
from icekv.engine.kv_manager import Admission, KVCacheManager
from icekv.engine.scheduler import Scheduler
from icekv.errors import IcekvError
from icekv.sizing import DeviceNeed

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=250)


@dataclass
class _Pool:
    """The part of :class:`icekv.kv.PagedKVCache` admission reads: pages, and who holds how many."""

    num_pages: int
    page_size: int = 16
    held: dict[int, int] = field(default_factory=dict)
    value_bytes_per_token: int = 1
    pool_on_compute: bool = True

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pages_available(self) -> int:
        return self.num_pages - sum(self.held.values())

    def pages_held(self, seq_id: int) -> int:
        return self.held.get(seq_id, 0)


@dataclass(eq=False)
class _Seq:
    """A request as the scheduler sees it: its charge, and how far it has run (``steps`` in all,
    the first ``prompt_steps`` of them prefill)."""

    seq_id: int
    admission: Admission
    request: SimpleNamespace
    steps: int
    prompt_steps: int
    ran: int = 0
    queued_at: float = 0.0
    cancel_requested: bool = False
    cancel_error: BaseException | None = None

    @property
    def decoding(self) -> bool:
        return self.ran >= self.prompt_steps

    @property
    def remaining_prompt(self) -> int:
        return max(self.prompt_steps - self.ran, 0)


@st.composite
def _workload(draw):
    """A pool, its limits, and requests that each fit alone, arriving over a few steps."""
    pool = _Pool(draw(st.integers(1, 64)))
    index_limit, context_limit = draw(st.integers(0, 1000)), draw(st.integers(0, 1000))
    device_limit = draw(st.none() | st.integers(0, 1000))
    contexts = [SimpleNamespace(nbytes=draw(st.integers(0, context_limit))) for _ in range(2)]
    requests = []
    for seq_id in range(draw(st.integers(1, 12))):
        context = draw(st.sampled_from([None, *contexts]))
        most = draw(st.integers(0, device_limit if device_limit is not None else 1000))
        need = DeviceNeed(*draw(st.permutations([most, draw(st.integers(0, most))])))
        steps = draw(st.integers(1, 5))
        admission = Admission(draw(st.integers(1, pool.num_pages)), draw(st.integers(0, index_limit)),
                              context.nbytes if context is not None else 0, need)
        requests.append((draw(st.integers(0, 6)), _Seq(seq_id, admission, SimpleNamespace(context=context), steps,
                                                       draw(st.integers(0, steps)))))
    cfg = SchedulerConfig(max_active_requests=draw(st.integers(1, 4)), max_queued_requests=len(requests),
                          max_step_tokens=64, max_index_bytes=index_limit, max_context_bytes=context_limit,
                          max_device_bytes=device_limit, max_queue_wait_s=1e9)
    return pool, cfg, sorted(requests, key=lambda r: r[0])


def _check_promises(kv: KVCacheManager, pool: _Pool, cfg: SchedulerConfig, running: list[_Seq]) -> None:
    assert len(running) <= cfg.max_active_requests
    assert sum(s.admission.pages for s in running) <= pool.num_pages
    assert sum(s.admission.index_bytes for s in running) <= cfg.max_index_bytes
    contexts = {id(s.request.context): s.admission.context_bytes for s in running if s.request.context is not None}
    assert sum(contexts.values()) <= cfg.max_context_bytes
    if cfg.max_device_bytes is not None:
        assert kv.device_promised(running) <= cfg.max_device_bytes


@SETTINGS
@given(workload=_workload())
def test_admission_never_promises_past_the_pool_and_admits_every_request_in_turn(workload):
    pool, cfg, requests = workload
    kv = KVCacheManager(pool, None, cfg, cfg.max_device_bytes, "cpu", 512)
    scheduler = Scheduler(cfg, kv, chunk_tokens=8)
    admitted, finished, pending = [], [], list(requests)
    bound = requests[-1][0] + sum(seq.steps for _, seq in requests) + len(requests) + 1
    for step in range(bound):
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        out = scheduler.schedule()
        assert not out.dropped
        _check_promises(kv, pool, cfg, scheduler.running)
        admitted += [s for s in scheduler.running if s not in admitted]
        for seq, _ in out.work:  # each runs a step, holding a growing share of its worst case
            seq.ran += 1
            pool.held[seq.seq_id] = min(seq.admission.pages, math.ceil(seq.admission.pages * seq.ran / seq.steps))
            if seq.ran == seq.steps:
                scheduler.remove(seq)
                del pool.held[seq.seq_id]
                finished.append(seq)
        assert set(map(id, scheduler.running)) == {id(s) for s, _ in out.work if s.ran < s.steps}
    assert [s.seq_id for s in admitted] == [seq.seq_id for _, seq in requests]  # all, first come first served
    assert len(finished) == len(requests) and not scheduler.waiting and not scheduler.running


@SETTINGS
@given(prompt=st.integers(0, 5000), max_tokens=st.integers(1, 5000), num_pages=st.integers(1, 300),
       page_size=st.integers(1, 64), prefill_only=st.booleans())
def test_a_request_is_charged_the_pages_of_its_tokens_and_fits_the_empty_pool_if_the_engine_lets_it_in(
        prompt, max_tokens, num_pages, page_size, prefill_only):
    pool = _Pool(num_pages, page_size)
    kv = KVCacheManager(pool, None, SchedulerConfig(), None, "cpu", 512)
    request = SimpleNamespace(prompt_ids=[0] * prompt, sampling=SimpleNamespace(max_tokens=max_tokens), context=None,
                              prefill_only=prefill_only, plan=SimpleNamespace(name="full"))
    seq = SimpleNamespace(seq_id=0, request=request, selects=False)
    seq.admission = kv.admission(seq)
    tokens = prompt + (0 if prefill_only else max_tokens)
    assert (seq.admission.pages - 1) * page_size < tokens <= seq.admission.pages * page_size or tokens == 0
    try:
        Engine.check_fits(SimpleNamespace(cache=pool), prompt, max_tokens)
    except IcekvError:
        assert prompt == 0 or prompt + max_tokens > pool.capacity_tokens
        return
    assert seq.admission.pages <= pool.num_pages and kv.can_allocate(seq, [])
