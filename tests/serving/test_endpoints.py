"""HTTP generate, SSE generate_stream and gRPC streaming against a real tritonserver."""

import threading

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.serving.client import Final, stream_generate
from tests.serving.conftest import metrics, post, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]
PARIS = "The capital of France is"


def test_generate_returns_text_and_kv_statistics(server):
    status, out = post(server, "/v2/models/icekv/generate", {"text_input": PARIS, "max_tokens": 8})
    assert status == 200, out
    assert "Paris" in out["text_output"]
    assert out["new_tokens"] == 8 and out["prompt_tokens"] == 5 and out["finish_reason"] == "length"
    assert out["policy"] == "icecache" and out["budget"] == 256
    assert out["kv_total_bytes"] > 0 and out["kv_resident_bytes"] > 0


def test_generate_stream_sends_one_event_per_piece(server):
    _, whole = post(server, "/v2/models/icekv/generate", {"text_input": PARIS, "max_tokens": 8})
    status, events = post(server, "/v2/models/icekv/generate_stream", {"text_input": PARIS, "max_tokens": 8, "stream": True})
    assert status == 200
    pieces = [e["text_output"] for e in events]
    assert len([p for p in pieces if p]) >= 3
    assert "".join(pieces) == whole["text_output"]
    assert events[-1]["finish_reason"] == "length" and events[-1]["new_tokens"] == 8


def test_grpc_streaming_with_tritonclient(server):
    parts = list(stream_generate(server.grpc_url, PARIS, max_tokens=8))
    final = parts[-1]
    assert isinstance(final, Final) and final.new_tokens == 8
    assert "Paris" in "".join(parts[:-1])


def test_parameters_are_honoured(server):
    _, short = post(server, "/v2/models/icekv/generate", {"text_input": PARIS, "max_tokens": 3})
    assert short["new_tokens"] == 3
    _, full = post(server, "/v2/models/icekv/generate", {"text_input": PARIS, "max_tokens": 4, "policy": "full"})
    assert full["policy"] == "full" and full["kv_bytes_moved"] == 0 and full["kv_resident_bytes"] == full["kv_total_bytes"]
    _, quest = post(server, "/v2/models/icekv/generate",
                    {"text_input": PARIS, "max_tokens": 4, "parameters": {"policy": "quest", "budget": 128}})
    assert quest["policy"] == "quest" and quest["budget"] == 128
    _, stopped = post(server, "/v2/models/icekv/generate", {"text_input": PARIS, "max_tokens": 8, "stop": ["."]})
    assert stopped["text_output"] == " Paris" and stopped["finish_reason"] == "stop"
    sampled = lambda seed: post(server, "/v2/models/icekv/generate", {
        "text_input": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": seed})[1]["text_output"]
    assert sampled(5) == sampled(5)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1


def test_a_repeated_prompt_is_answered_over_its_cached_pages(server):
    body = {"text_input": "Rome is the capital of Italy. " * 30, "max_tokens": 6, "policy": "full"}
    _, first = post(server, "/v2/models/icekv/generate", body)
    _, again = post(server, "/v2/models/icekv/generate", {**body, "cache_retention_s": 30})
    _, off = post(server, "/v2/models/icekv/generate", {**body, "cache_prompt": False})
    assert first["cached_tokens"] == 0 and again["cached_tokens"] >= first["prompt_tokens"] - 16
    assert off["cached_tokens"] == 0
    assert again["text_output"] == first["text_output"] == off["text_output"]
    m = wait_idle(server)
    assert m["icekv_prefix_cache_hit_tokens_total"] >= again["cached_tokens"] and m["icekv_prefix_cache_pages"] > 0
    assert m["icekv_prefix_cache_miss_tokens_total"] > 0


def test_metrics_are_exposed_and_move(server):
    before = metrics(server)
    for name in ("icekv_kv_resident_bytes", "icekv_kv_host_bytes", "icekv_pages_moved_total",
                 "icekv_selection_seconds_total", "icekv_context_store_hits_total", "icekv_active_requests"):
        assert name in before
    post(server, "/v2/models/icekv/generate", {"text_input": PARIS * 60, "max_tokens": 6})
    after = wait_idle(server)
    assert after["icekv_generated_tokens_total"] >= before["icekv_generated_tokens_total"] + 6
    assert after["icekv_selection_seconds_total"] > before["icekv_selection_seconds_total"]
    assert after["icekv_pages_moved_total"] > before["icekv_pages_moved_total"]


def test_concurrent_streams_all_complete_with_their_own_answers(server):
    prompts = [f"Question {i}: the capital of France is" for i in range(6)]
    expected = {p: post(server, "/v2/models/icekv/generate", {"text_input": p, "max_tokens": 10})[1]["text_output"]
                for p in prompts}
    got, errors = {}, []

    def run(p):
        try:
            got[p] = "".join(x for x in stream_generate(server.grpc_url, p, max_tokens=10) if isinstance(x, str))
        except Exception as e:  # collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and got == expected
    wait_idle(server)


def test_grpc_cancel_frees_the_request(server):
    before = metrics(server)
    stream = stream_generate(server.grpc_url, PARIS * 50, max_tokens=400, stop=[])
    assert isinstance(next(stream), str)
    stream.close()  # stops the stream with cancel_requests=True
    after = wait_idle(server)
    assert after["icekv_requests_cancelled_total"] >= before["icekv_requests_cancelled_total"] + 1


def test_context_key_answers_over_a_stored_compressed_context(server, engine):
    from icekv.store import ContextStore

    context = "The secret code of the vault is 4417. " + "The weather was mild and the market was busy. " * 30
    ids = engine.tokenizer.encode(context)
    store = ContextStore.open(str(server.store_dir), engine.model_id)
    key = store.key(ids, "snapkv", 1.0)
    store.save(key, engine.compress(ids, "snapkv", 1.0))
    question = " Question: what is the secret code of the vault? Answer: The secret code is"
    direct = engine.generate(context + question, SamplingConfig(max_tokens=6), selection=SelectionConfig(policy="full"))
    before = metrics(server)
    body = {"text_input": question, "max_tokens": 6, "context_key": key}
    status, out = post(server, "/v2/models/icekv/generate", {**body, "policy": "full"})
    assert status == 200, out
    assert out["text_output"] == direct.text and out["policy"] == "full"
    assert out["prompt_tokens"] == len(engine.tokenizer.encode(question))
    status, sparse = post(server, "/v2/models/icekv/generate", {**body, "policy": "icecache", "budget": 128})
    assert status == 200 and sparse["policy"] == "icecache" and sparse["new_tokens"] >= 1, sparse
    status, bad = post(server, "/v2/models/icekv/generate", {**body, "policy": "quest"})
    assert status == 400 and "cannot select over a compressed context" in bad["error"]
    after = wait_idle(server)
    assert after["icekv_context_store_hits_total"] == before["icekv_context_store_hits_total"] + 3
