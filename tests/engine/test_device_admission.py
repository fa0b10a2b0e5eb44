"""With the pool off the compute device, admission charges what requests hold there: a prefill
every global layer's K/V of its prompt and about a local layer's window, a budgeted decode far
less. Run on the CPU by telling the engine its pool is not where attention runs, with a real
random-weight model."""

from dataclasses import replace

import pytest

from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.errors import IcekvError
from icekv.kv import PagedKVCache
from icekv.model.random import SHAPES
from icekv.policies import resolve
from icekv.sizing import device_need

SPARSE = SelectionConfig(policy="icecache", budget=64, n_unlimited_layers=1)
SAMPLING = SamplingConfig(max_tokens=8, ignore_eos=True)
PROMPT = [3 + i % 500 for i in range(900)]


def _engine(monkeypatch, limit: int | None, chunk: int = 512) -> Engine:
    monkeypatch.setattr(PagedKVCache, "pool_on_compute", property(lambda self: False))
    return Engine(EngineConfig(random_weights="llama-tiny", device="cpu", paging=PagingConfig(pool_tokens=8192),
                               scheduler=SchedulerConfig(max_device_bytes=limit), prefill_chunk_tokens=chunk))


def _need(engine: Engine, selection=SPARSE):
    args = engine.model.args
    return device_need(args, len(PROMPT), SAMPLING.max_tokens, resolve(selection),
                       engine.cache.bytes_per_token // args.num_layers, device_type="cpu",
                       chunk_tokens=engine.config.prefill_chunk_tokens)


def _device_bytes(seq) -> int:
    """What the request's backend really holds on the compute device: mirrors, slots, tails and
    the selector's copies."""
    backend = seq.backend
    held = sum(kv.nbytes for kv in getattr(backend.source.whole, "kv", {}).values())  # a mirror's copies
    for name in ("device", "tails"):
        held += sum(getattr(d, "resident_bytes", getattr(d, "nbytes", 0)) for d in getattr(backend, name, {}).values())
    selector = getattr(backend, "selector", None)
    return held + (selector.device_bytes() if selector else 0)


def test_a_second_prefill_waits_for_the_first_to_reach_its_decode(monkeypatch):
    probe = _engine(monkeypatch, 1)
    need = _need(probe)
    assert need.decode < need.prefill / 2  # a budgeted decode holds far less than its prefill
    engine = _engine(monkeypatch, int(1.5 * need.prefill))
    first, second = (engine.submit(PROMPT, SAMPLING, SPARSE) for _ in range(2))
    held = {"prefill": 0, "decode": 0}
    overlapped = False
    while not (first.done and second.done):
        engine.step()
        running = engine.scheduler.running
        assert not (first in running and second in running and not first.decoding)  # never two prefills
        overlapped |= first in running and second in running  # the second's prefill beside the first's decode
        for seq in running:
            phase = "decode" if seq.decoder_ready else "prefill"  # the backend it holds (the prefill one
            # is dropped in the step after the prompt's last chunk, before any new prefill allocates)
            held[phase] = max(held[phase], _device_bytes(seq))
    assert first.error is None and second.error is None and len(second.result.token_ids) == 8
    assert overlapped
    assert 0.9 * need.prefill <= held["prefill"] <= need.prefill  # the estimates bound what was really held
    assert 0 < held["decode"] <= need.decode


def test_full_attention_holds_what_its_estimate_says(monkeypatch):
    engine = _engine(monkeypatch, None)
    seq = engine.submit(PROMPT, SAMPLING, SelectionConfig(policy="full"))
    most = 0
    while not seq.done:
        engine.step()
        if not seq.done:
            most = max(most, _device_bytes(seq))
    need = _need(engine, SelectionConfig(policy="full"))
    assert need.decode * 0.9 <= most <= need.decode  # every layer's tokens, sized once


def test_a_request_that_could_never_fit_the_device_is_refused(monkeypatch):
    engine = _engine(monkeypatch, 1 << 20)
    with pytest.raises(IcekvError, match=r"needs ~\d+ MiB of device memory .* above max_device_bytes \(1 MiB\)"
                                         r": shorten the prompt, or compress it as a context"):
        engine.submit(PROMPT, SAMPLING, SPARSE)
    monkeypatch.setattr(engine.kv, "args", replace(engine.model.args, sliding_window=64, local_layers=(0,)))
    with pytest.raises(IcekvError, match=r"MiB\): shorten the prompt$"):  # a windowed model takes no contexts
        engine.submit(PROMPT, SAMPLING, SPARSE)
    short = engine.run(engine.submit(PROMPT[:40], SAMPLING, SPARSE))  # a short one is served
    assert len(short.token_ids) == 8


@pytest.mark.parametrize("chunk", [64, 200])  # a prefill chunk of the window, and of three
def test_a_local_layer_s_prefill_is_charged_and_holds_about_its_window(monkeypatch, chunk):
    windowed = replace(SHAPES["llama-tiny"], sliding_window=64, local_layers=(0, 1, 2))  # layer 3 global
    monkeypatch.setitem(SHAPES, "llama-tiny", windowed)
    engine = _engine(monkeypatch, None, chunk=chunk)
    seq = engine.submit(PROMPT, SAMPLING, SelectionConfig(policy="full"))
    most = 0
    while not seq.decoder_ready and not seq.done:
        engine.step()
        most = max(most, _device_bytes(seq))
    assert len(engine.run(seq).token_ids) == SAMPLING.max_tokens
    need = _need(engine, SelectionConfig(policy="full"))
    per_layer = engine.cache.bytes_per_token // windowed.num_layers
    assert need.prefill <= (len(PROMPT) + 3 * (2 * 64 + chunk)) * per_layer  # the local layers: two windows, a chunk
    assert 0.8 * need.prefill <= most <= need.prefill
