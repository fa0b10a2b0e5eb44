"""Admission counts the page index's host memory as well as the KV pages (real engine, real model),
through the serving engine thread."""

import pytest

from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.errors import IcekvError
from icekv.serving.engine_loop import EngineLoop
from icekv.serving.request import GenerateRequest
from icekv.policies import resolve
from tests.serving.sinks import RecordingSink


def _request(essays_text, policy: str, words: int = 250, max_tokens: int = 6) -> GenerateRequest:
    text = " ".join(essays_text.split()[:words])
    return GenerateRequest(text, SamplingConfig(max_tokens=max_tokens, ignore_eos=True),
                           resolve(SelectionConfig(policy=policy, budget=64)), stream=True, context_key=None)


def _estimate(engine, request) -> int:
    tokens = len(engine.tokenizer.encode(request.text)) + request.sampling.max_tokens
    return request.plan.index_bytes(engine.model.args, tokens, engine.cache.pool.dtype)


@pytest.fixture
def loop_for(smollm2_dir):
    made = []

    def make(max_index_bytes):
        cfg = EngineConfig(model_dir=str(smollm2_dir),
                           scheduler=SchedulerConfig(max_active_requests=4, max_index_bytes=max_index_bytes))
        made.append(EngineLoop(lambda: Engine(cfg)))
        return made[-1]
    yield make
    for loop in made:
        loop.stop()


def test_a_request_whose_index_could_never_fit_is_refused_up_front(engine, essays_text, loop_for):
    loop = loop_for(1 << 20)
    ice = _request(essays_text, "icecache")
    assert _estimate(engine, ice) > 1 << 20
    with pytest.raises(IcekvError, match="max_index_bytes"):
        loop.submit(ice, RecordingSink(loop))
    streaming = RecordingSink(loop)  # no index: the same prompt is served
    loop.submit(_request(essays_text, "streaming"), streaming)
    assert streaming.finished.wait(120) and streaming.failure is None
    assert streaming.result.new_tokens == 6


def test_requests_wait_for_index_memory_then_all_complete(engine, essays_text, loop_for):
    first, second = _request(essays_text, "icecache"), _request(essays_text, "icecache", words=240)
    one = max(_estimate(engine, first), _estimate(engine, second))
    loop = loop_for(int(1.5 * one))  # room for one index at a time (KV pages: plenty)
    sinks = [RecordingSink(loop), RecordingSink(loop)]
    loop.submit(first, sinks[0])
    loop.submit(second, sinks[1])
    for sink in sinks:
        assert sink.finished.wait(180) and sink.failure is None
        assert sink.result.new_tokens == 6
        assert sink.seen_active == 1  # never both at once
    assert loop.stats.index_bytes_promised == 0 and loop.stats.active == 0


def test_default_index_limit_is_the_kv_pool_size(loop_for):
    loop = loop_for(None)
    cache = loop.engine.cache
    assert loop.engine.kv.index_limit == cache.capacity_tokens * cache.bytes_per_token > 0
