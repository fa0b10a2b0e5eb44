"""Two live icekv replicas over one real Redis behind a real SGLang Model Gateway (loopback only):
each conversation's turns stay on the replica holding its prefix; the metrics endpoint pickers
read are there and move; replicas read each other's prefix pages and refuse a corrupted one; a
replica killed mid-stream loses no turn (the next lands on the survivor, its prefix from the
store, its answer the uninterrupted one); requests a replica refuses leave it in the rotation."""

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from icekv.serving.replicas import Replica, ReplicaSupervisor, RouterProcess
from tests.serving.conftest import wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]

PAGE = 16  # the default page size: prefix hits come in whole pages
WAIT_S = 120  # the longest any one request or wait here may take


@pytest.fixture(scope="module")
def store_url(redis_url):
    import redis

    url = redis_url.rsplit("/", 1)[0] + "/7"  # a database of its own: the keys here are this module's
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.close()


@pytest.fixture(scope="module")
def fleet(smollm2_dir, store_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    parameters = {"store": store_url, "prefix_cache_spill": "true", "pool_tokens": "4096", "policy": "full"}
    replicas = [Replica(parameters, WAIT_S, None, logs, i) for i in range(2)]
    router = None
    try:
        for replica in replicas:
            replica.start()
        router = RouterProcess(tuple(r.url for r in replicas), "cache_aware", log_path=logs / "router.log").start()
        yield replicas, router
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def _post(url: str, body: dict, route: str = "/v1/chat/completions") -> dict:
    request = urllib.request.Request(f"{url}{route}", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=WAIT_S) as response:
        return json.load(response)


def _chat(url: str, messages: list, max_tokens: int = 6, **extra) -> dict:
    return _post(url, {"model": "icekv", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _totals(replicas, name: str) -> list[float]:
    return [wait_idle(r.server)[name] for r in replicas]


def _document(essays_text: str, index: int, words: int = 260) -> str:
    chunk = essays_text.split()[index * words:(index + 1) * words]
    return f"Document {index}.\n" + " ".join(chunk)


def test_the_router_sees_both_replicas_ready(fleet):
    _, router = fleet
    assert json.loads(_get(f"{router.url}/readiness")) == {"status": "ready", "healthy_workers": 2,
                                                           "total_workers": 2}


def test_each_turn_lands_where_its_conversation_is(fleet, essays_text):
    """Turns 2-3 of three concurrent conversations find their prefix in the pool of the replica
    they land on: cached tokens, and not one page read back from the store (a turn sent to the
    other replica would have read its prefix from the store)."""
    replicas, router = fleet
    reloaded = _totals(replicas, "icekv_prefix_cache_reloaded_pages_total")
    completed = _totals(replicas, "icekv_requests_completed_total")

    def conversation(index: int) -> list[dict]:
        messages, turns = [{"role": "user", "content": _document(essays_text, index) + "\nSummarize it."}], []
        for turn in range(3):
            answer = _chat(router.url, messages)
            turns.append(answer["usage"])
            messages += [answer["choices"][0]["message"], {"role": "user", "content": f"Now point {turn + 2}?"}]
        return turns

    with ThreadPoolExecutor(3) as pool:
        conversations = list(pool.map(conversation, range(3)))
    for turns in conversations:
        for before, after in zip(turns, turns[1:]):
            assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"] // PAGE * PAGE
    assert sum(_totals(replicas, "icekv_requests_completed_total")) - sum(completed) == 9
    assert _totals(replicas, "icekv_prefix_cache_reloaded_pages_total") == reloaded


def _cached(url: str, route: str, body: dict) -> int:
    """The prompt tokens a request found in the prefix cache."""
    return _post(url, body, route)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_icekv_s_own_fields_pass_the_gateway_on_completions_only(fleet, essays_text):
    """The gateway forwards a completion's fields it does not know, and rebuilds a chat completion
    from its own schema without them (what docs/serving.md tells users): ``cache_prompt: false``
    makes a replica prefill a prompt whole on the first route, while on the second it never
    arrives (the prompt's pages are found), though the replica honours it sent to it directly."""
    replicas, router = fleet
    text = _document(essays_text, 7, words=120)
    completion = {"model": "icekv", "prompt": text, "max_tokens": 2, "temperature": 0}
    _cached(router.url, "/v1/completions", completion)  # its pages cached (and in the store)
    assert _cached(router.url, "/v1/completions", completion) > 0
    assert _cached(router.url, "/v1/completions", {**completion, "cache_prompt": False}) == 0
    chat = {"model": "icekv", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    _cached(router.url, "/v1/chat/completions", chat)
    assert _cached(router.url, "/v1/chat/completions", {**chat, "cache_prompt": False}) > 0
    assert _cached(replicas[0].url, "/v1/chat/completions", {**chat, "cache_prompt": False}) == 0


def _status(url: str, body: dict) -> int:
    """A completion's HTTP status."""
    try:
        _post(url, body, "/v1/completions")
        return 200
    except urllib.error.HTTPError as e:
        return e.code


def test_refused_requests_take_no_replica_out_of_the_rotation(fleet, essays_text):
    """A request each replica refuses (a 400: an unknown policy) leaves both in the gateway's
    rotation: the next requests are all answered, by both replicas (a gateway whose circuit
    breaker counted the refusals would answer 503, or send everything to one replica)."""
    replicas, fleet_router = fleet
    router = RouterProcess(fleet_router.worker_urls, "round_robin").start()  # each replica in turn
    try:
        text = _document(essays_text, 12, words=40)
        body = {"model": "icekv", "prompt": text, "max_tokens": 1, "temperature": 0}
        assert [_status(router.url, {**body, "policy": "no_such_policy"}) for _ in replicas] == [400, 400]
        completed = _totals(replicas, "icekv_requests_completed_total")
        assert [_status(router.url, body) for _ in range(4)] == [200] * 4
        served = [b - a for a, b in zip(completed, _totals(replicas, "icekv_requests_completed_total"))]
        assert served == [2, 2]
    finally:
        router.stop()


def _samples(text: str) -> dict[str, tuple[str, float]]:
    """name -> (labels, value) of each vLLM-named sample; TYPE lines as name -> ("TYPE", kind)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE vllm:"):
            out["type " + line.split()[2]] = ("TYPE", line.split()[3])
        elif line.startswith("vllm:"):
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            out[name] = (labels, float(value))
    return out


def test_the_endpoint_pickers_metrics_are_served_and_move(fleet, essays_text):
    replicas, _ = fleet
    target = replicas[0]
    for name, kind in (("vllm:num_requests_waiting", "gauge"), ("vllm:num_requests_running", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries_total", "counter")):
        for replica in replicas:
            samples = _samples(_get(f"{replica.url}/metrics"))
            assert samples["type " + name] == ("TYPE", kind)
            assert samples[name][0] == 'model_name="icekv"'
    assert "icekv_requests_completed_total" in _get(f"{target.url}/metrics")  # icekv's own, beside them
    queries = _samples(_get(f"{target.url}/metrics"))["vllm:prefix_cache_queries_total"][1]
    messages = [{"role": "user", "content": _document(essays_text, 5) + "\nWrite a long story about it."}]
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_chat, target.url, messages, 64)
        busy, deadline = None, time.monotonic() + WAIT_S
        while busy is None and time.monotonic() < deadline and not reply.done():
            samples = _samples(_get(f"{target.url}/metrics"))
            if samples["vllm:num_requests_running"][1] >= 1 and samples["vllm:kv_cache_usage_perc"][1] > 0:
                busy = samples
            time.sleep(0.05)
        reply.result()
    assert busy is not None, "the running request and its pages never showed in /metrics"
    assert 0 < busy["vllm:kv_cache_usage_perc"][1] <= 1
    wait_idle(target.server)
    after = _samples(_get(f"{target.url}/metrics"))
    assert after["vllm:num_requests_running"][1] == 0 and after["vllm:kv_cache_usage_perc"][1] == 0
    assert after["vllm:prefix_cache_queries_total"][1] > queries


def _new_keys(client, before: set) -> list[bytes]:
    return [k for k in client.scan_iter("icekv:ctx:*") if k not in before]


@pytest.mark.parametrize("writer, reader", [(0, 1), (1, 0)])
def test_each_replica_reads_the_others_pages_and_refuses_a_corrupted_one(fleet, store_url, essays_text, writer,
                                                                         reader):
    """Concurrently, both replicas serve one prompt (each writes its pages, each reads the other's
    or its own: no refusal); then the pages one replica wrote for a new prompt are corrupted in
    Redis, and the other refuses them and answers as if they had never been stored."""
    import redis

    replicas, _ = fleet
    client = redis.Redis.from_url(store_url)
    refused = _totals(replicas, "icekv_prefix_cache_spill_refused_total")
    shared = [{"role": "user", "content": _document(essays_text, 10 + writer) + "\nName its topic."}]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda r: _chat(r.url, shared), replicas))
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert _totals(replicas, "icekv_prefix_cache_spill_refused_total") == refused

    before = set(client.scan_iter("icekv:ctx:*"))
    messages = [{"role": "user", "content": _document(essays_text, 20 + writer) + "\nName its topic."}]
    expected = _chat(replicas[writer].url, messages)
    wait_idle(replicas[writer].server)
    pages = (expected["usage"]["prompt_tokens"] - 1) // PAGE  # the last prompt token is always prefilled
    keys, deadline = _new_keys(client, before), time.monotonic() + WAIT_S
    while len(keys) < pages - 1 and time.monotonic() < deadline:  # its first page: the chat template's, stored
        time.sleep(0.2)
        keys = _new_keys(client, before)
    assert len(keys) >= pages - 1
    for key in keys:
        end = client.strlen(key) - 1
        client.setrange(key, end, bytes([client.getrange(key, end, end)[0] ^ 0xFF]))
    refused = _totals(replicas, "icekv_prefix_cache_spill_refused_total")[reader]
    got = _chat(replicas[reader].url, messages)
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] <= (pages - len(keys)) * PAGE  # none corrupted
    assert _totals(replicas, "icekv_prefix_cache_spill_refused_total")[reader] > refused
    client.close()


def _stream_until_killed(url: str, body: dict, kill) -> tuple[str, float]:
    """Stream ``body``; after its first content chunk call ``kill``; read on until the stream ends.
    Returns how it ended ("done", "error event" or "connection closed") and the seconds it took."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT_S)
    connection.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                       {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    killed_at = None
    try:
        while True:
            line = response.readline()
            if not line:
                return "connection closed", time.monotonic() - killed_at
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return "done", time.monotonic() - (killed_at or time.monotonic())
            if b'"error"' in data and killed_at is not None:
                return "error event", time.monotonic() - killed_at
            if killed_at is None and b'"content"' in data:
                kill()
                killed_at = time.monotonic()
    except (http.client.HTTPException, OSError):
        return "connection closed", time.monotonic() - killed_at
    finally:
        connection.close()


def test_a_replica_killed_mid_stream_loses_no_turn(fleet, essays_text):
    """Runs last in this module: it kills a replica."""
    replicas, router = fleet
    completed = _totals(replicas, "icekv_requests_completed_total")
    messages = [{"role": "user", "content": _document(essays_text, 30) + "\nWhat is the main claim?"}]
    first = _chat(router.url, messages)
    served = [b - a for a, b in zip(completed, _totals(replicas, "icekv_requests_completed_total"))]
    assert sorted(served) == [0, 1]
    owner, survivor = (replicas[0], replicas[1]) if served[0] else (replicas[1], replicas[0])
    messages += [first["choices"][0]["message"], {"role": "user", "content": "Give one example of it."}]
    body = {"model": "icekv", "messages": messages, "max_tokens": 48, "temperature": 0}
    reloaded = wait_idle(survivor.server)["icekv_prefix_cache_reloaded_pages_total"]

    def kill():
        for process in (owner.server.process, owner.frontend.process):
            os.killpg(process.pid, signal.SIGKILL)

    ended, seconds = _stream_until_killed(router.url, body, kill)
    assert ended in ("error event", "connection closed", "done") and seconds < 30
    try:  # at once: the gateway retries it on the survivor if the health check has not yet run
        again = _chat(router.url, messages, 48)
    except urllib.error.HTTPError as e:
        pytest.fail(f"the turn after the kill failed: {e.code} {e.read()[:200]!r}")
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    new_tokens = again["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // PAGE * PAGE  # the first turn's prompt, from the store
    assert again["usage"]["prompt_tokens"] - cached < new_tokens + PAGE  # recomputed: this turn's new tokens
    assert wait_idle(survivor.server)["icekv_prefix_cache_reloaded_pages_total"] > reloaded
    uninterrupted = _chat(survivor.url, messages, 48, cache_prompt=False)  # prefilled whole, no cache
    assert again["choices"][0]["message"] == uninterrupted["choices"][0]["message"]


def test_the_killed_replica_starts_again_and_serves(fleet, store_url, essays_text):
    """Runs after the kill: the supervisor starts the dead replica again on its port; the router
    takes it back, and it answers a conversation another replica began from the shared store."""
    import redis

    replicas, router = fleet
    supervisor = ReplicaSupervisor(replicas, first_delay_s=0.0)
    events = supervisor.poll()
    dead = [r for r in replicas if any(r.url in e for e in events)]
    assert len(dead) == 1 and "stopped" in events[0] and supervisor.serving == 1
    events, deadline = [], time.monotonic() + WAIT_S
    while not events:  # its start runs on a thread; the polls see it end
        assert time.monotonic() < deadline, "the replica did not start again"
        time.sleep(0.5)
        events = supervisor.poll()
    assert events == [f"replica {dead[0].url} started again"] and supervisor.serving == 2
    assert dead[0].exited() is None
    deadline = time.monotonic() + 30
    while json.loads(_get(f"{router.url}/readiness")).get("healthy_workers") != 2:
        assert time.monotonic() < deadline, "the router did not take the restarted replica back"
        time.sleep(0.5)
    messages = [{"role": "user", "content": _document(essays_text, 31) + "\nWhat is the main claim?"}]
    survivor = next(r for r in replicas if r is not dead[0])
    client = redis.Redis.from_url(store_url)
    before = set(client.scan_iter("icekv:ctx:*"))
    expected = _chat(survivor.url, messages)
    deadline = time.monotonic() + WAIT_S
    while not _new_keys(client, before):  # the survivor's pages, spilled to the store
        assert time.monotonic() < deadline, "the survivor stored no page"
        time.sleep(0.2)
    client.close()
    reloaded = wait_idle(dead[0].server)["icekv_prefix_cache_reloaded_pages_total"]
    got = _chat(dead[0].url, messages)
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the survivor's pages, from the store
    assert wait_idle(dead[0].server)["icekv_prefix_cache_reloaded_pages_total"] > reloaded
