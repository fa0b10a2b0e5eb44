"""The prefix cache's page events over a real ZMQ socket: what the cache keeps and drops is heard in
chain order with its tokens, decodes with vLLM's own KV-event types (the format llm-d's and Dynamo's
indexers read), is replayed to a late subscriber as vLLM's publisher replays, and a served request's
cached pages are published by a real server."""

import json
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from icekv.config.settings import serving_config
from icekv.errors import ConfigError
from icekv.kv.prefix_cache import PrefixCache, page_keys
from icekv.serving.kv_events import EventBatch, KVEventPublisher
from icekv.serving.launcher import TritonServer, free_port
from tests.serving.conftest import post

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
P = 4  # page size of the unit tests
DECODE_WITH_VLLM = """
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

decoder, out = msgspec.msgpack.Decoder(type=KVEventBatch), []
for payload in json.load(sys.stdin):
    batch = decoder.decode(bytes.fromhex(payload))
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(["stored", [h.hex() for h in e.block_hashes], e.parent_block_hash and e.parent_block_hash.hex(),
                        e.token_ids, e.block_size, e.medium])
        elif isinstance(e, BlockRemoved):
            out.append(["removed", [h.hex() for h in e.block_hashes], e.medium])
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(["cleared"])
print(json.dumps(out))
"""


REPLAY_CLIENT = """
import zmq

def replay(endpoint, start):
    # what a replay socket answers a DEALER asking for the batches from start on: each answer's
    # frames, up to and including the end marker
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart((b"", start.to_bytes(8, "big")))
    answers = []
    while not answers or answers[-1][2] != (-1).to_bytes(8, "big", signed=True):
        assert socket.poll(10_000), f"no answer after {answers}"
        answers.append(socket.recv_multipart())
    socket.close(linger=0)
    return answers
"""
VLLM_REPLAYS = REPLAY_CLIENT + """
import json, sys, time
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

publisher = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2], topic="kv@test")
for i in range(3):
    publisher.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
time.sleep(1)
print(json.dumps([[f.hex() for f in answer] for answer in replay(sys.argv[2], 1)]))
publisher.shutdown()
"""


class Subscriber:
    """A SUB socket read on a thread of its own from the start, as a real consumer reads (a socket
    nobody reads never takes in a new publisher, so it would never send it its subscription)."""

    def __init__(self, bind: str | None = None, connect: str | None = None):
        self.messages: list[list[bytes]] = []
        self._stop, ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._read, args=(bind, connect, ready), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _read(self, bind, connect, ready) -> None:
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.bind(bind) if bind else socket.connect(connect)
        ready.set()
        while not self._stop.is_set():
            if socket.poll(50):
                self.messages.append(socket.recv_multipart())
        socket.close(linger=0)

    def until(self, holds, timeout_s: float = 30) -> list[list[bytes]]:
        """The messages so far, once ``holds(messages)``."""
        deadline = time.monotonic() + timeout_s
        while not holds(list(self.messages)):
            assert time.monotonic() < deadline, f"events did not arrive: {self.messages}"
            time.sleep(0.05)
        return list(self.messages)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _events(messages) -> list:
    decoder = msgspec.msgpack.Decoder(type=EventBatch)
    return [e for m in messages for e in decoder.decode(m[2]).events]


@pytest.fixture
def published(tmp_path):
    """A prefix cache heard by a publisher bound on a local socket, and a subscriber connected to it."""
    publisher = KVEventPublisher(f"ipc://{tmp_path}/kv", "kv@test", P, "CPU", period_s=0.5)
    subscriber = Subscriber(connect=publisher.endpoint)
    cache = PrefixCache("model", P)
    cache.events = publisher
    yield cache, publisher, subscriber
    publisher.close()
    subscriber.close()


def test_is_bind_endpoint_follows_vllms_rule():
    from icekv.serving.kv_events import is_bind_endpoint

    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("tcp://0.0.0.0:5557") and is_bind_endpoint("ipc:///tmp/kv")
    assert not is_bind_endpoint("tcp://10.0.0.2:5557") and not is_bind_endpoint("tcp://10.0.0.0:5557")


def test_cached_and_evicted_pages_are_heard_in_chain_order(published):
    cache, publisher, subscriber = published
    ids = list(range(100, 100 + 3 * P + 2))  # three full pages and a partial one
    keys = page_keys("model", ids, P)
    dropped = cache.insert(ids, [7, 8, 9, 10])
    assert dropped == [10]
    evicted = cache.evict(2)
    messages = subscriber.until(lambda m: sum(len(_events([x])) for x in m) >= 5)
    assert [m[0] for m in messages] == [b"kv@test"] * len(messages)
    assert [int.from_bytes(m[1], "big") for m in messages] == list(range(len(messages)))  # from 0, no gap
    events = _events(messages)
    assert type(events[0]).__name__ == "AllBlocksCleared"  # a new process holds nothing
    stored = events[1:4]
    assert [e.block_hashes for e in stored] == [[k] for k in keys]  # each page's parent before it
    assert [e.parent_block_hash for e in stored] == [None, keys[0], keys[1]]
    assert [e.token_ids for e in stored] == [ids[i * P:(i + 1) * P] for i in range(3)]
    assert {(e.block_size, e.medium) for e in stored} == {(P, "CPU")}
    assert events[4].block_hashes == [keys[2], keys[1]] and evicted == [9, 8]  # a chain's tail goes first


def test_pages_published_while_their_request_runs_are_heard_once(published):
    cache, publisher, subscriber = published
    ids = list(range(7, 7 + 3 * P))
    keys = page_keys("model", ids, P)
    assert cache.publish(ids[:2 * P], [3, 4], 0) == 2  # a running request's final pages
    cache.insert(ids, [3, 4, 5], first=2)  # it ends: only its third page is new
    cache.insert(ids, [6, 7, 8])  # another request with the same tokens: nothing new
    subscriber.until(lambda m: sum(len(_events([x])) for x in m) >= 4)
    time.sleep(1.2)  # two more periods: anything else would have been sent
    events = _events(subscriber.messages)
    assert [e.block_hashes for e in events[1:]] == [[keys[0]], [keys[1]], [keys[2]]]
    assert events[3].parent_block_hash == keys[1] and events[3].token_ids == ids[2 * P:]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: `make setup-vllm` makes it")
def test_the_events_decode_with_vllms_own_types(published):
    cache, publisher, subscriber = published
    ids = list(range(50, 50 + 2 * P))
    keys = page_keys("model", ids, P)
    cache.insert(ids, [1, 2])
    cache.evict(2)
    messages = subscriber.until(lambda m: sum(len(_events([x])) for x in m) >= 4)
    run = subprocess.run([str(VLLM_PYTHON), "-c", DECODE_WITH_VLLM], input=json.dumps([m[2].hex() for m in messages]),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == [
        ["cleared"],
        ["stored", [keys[0].hex()], None, ids[:P], P, "CPU"],
        ["stored", [keys[1].hex()], keys[0].hex(), ids[P:], P, "CPU"],
        ["removed", [keys[1].hex(), keys[0].hex()], "CPU"],
    ]


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    scope: dict = {}
    exec(REPLAY_CLIENT, scope)
    return scope["replay"](endpoint, start)


def _one_batch_each(publisher, subscriber, sends) -> list[list[bytes]]:
    """Run each of ``sends`` once what the one before it sent has been heard (so each is its own
    batch); every message heard."""
    for send in sends:
        heard = len(subscriber.messages)
        send()
        subscriber.until(lambda m: len(m) > heard)
    return list(subscriber.messages)


def test_a_late_subscriber_gets_the_batches_it_missed_from_the_replay_socket(tmp_path):
    publisher = KVEventPublisher(f"ipc://{tmp_path}/kv", "kv@test", P, "CPU", period_s=0.05,
                                 replay_endpoint=f"ipc://{tmp_path}/replay", replay_batches=3)
    subscriber = Subscriber(connect=publisher.endpoint)  # hears what a late one missed
    cache = PrefixCache("model", P)
    cache.events = publisher
    try:
        ids = list(range(20, 20 + 4 * P))
        heard = _one_batch_each(publisher, subscriber, [
            lambda n=n: cache.insert(ids[:n * P], list(range(n))) for n in range(1, 5)])
        answers = _replay(publisher.replay_endpoint, 0)
        assert answers.pop() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]  # the end marker
        assert [a[1:] for a in answers] == heard[-3:]  # the last 3 batches, as published: topic, number, events
        assert {a[0] for a in answers} == {b""}
        keys = page_keys("model", ids, P)
        assert [e.block_hashes for e in _events(heard[-3:])] == [[k] for k in keys[1:]]
        last = int.from_bytes(heard[-1][1], "big")
        client = zmq.Context.instance().socket(zmq.DEALER)  # a malformed request is ignored, the next answered
        client.connect(publisher.replay_endpoint)
        client.send_multipart((b"", b"nope"))
        client.send_multipart((b"", last.to_bytes(8, "big")))
        assert client.poll(10_000) and client.recv_multipart()[1:] == heard[-1]
        assert client.poll(10_000) and client.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
        assert not client.poll(300)  # nothing for the malformed one
        client.close(linger=0)
    finally:
        publisher.close()
        subscriber.close()


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: `make setup-vllm` makes it")
def test_the_replay_answers_as_vllms_publisher_answers(tmp_path):
    run = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_REPLAYS, f"ipc://{tmp_path}/vllm", f"ipc://{tmp_path}/vllm-r"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = [[bytes.fromhex(f) for f in answer] for answer in json.loads(run.stdout.strip().splitlines()[-1])]
    publisher = KVEventPublisher(f"ipc://{tmp_path}/kv", "kv@test", P, "CPU", period_s=0.05,
                                 replay_endpoint=f"ipc://{tmp_path}/replay", replay_batches=10)
    subscriber = Subscriber(connect=publisher.endpoint)
    try:
        heard = _one_batch_each(publisher, subscriber, [lambda: publisher.removed([b"k" * 16])] * 2)
        ours = _replay(publisher.replay_endpoint, int.from_bytes(heard[-2][1], "big"))
    finally:
        publisher.close()
        subscriber.close()
    assert [len(a) for a in ours] == [len(a) for a in theirs] == [4, 4, 4]  # two batches and the end marker
    assert [a[:2] for a in ours] == [a[:2] for a in theirs]  # delimiter and topic (numbers: each its own)
    assert ours[-1] == theirs[-1]


def test_events_need_the_prefix_cache_and_a_usable_endpoint():
    with pytest.raises(ConfigError, match="kv_events_endpoint needs the prefix cache"):
        serving_config({"kv_events_endpoint": "tcp://*:5557", "prefix_cache": "false"})
    with pytest.raises(ConfigError, match="kv_events_endpoint must be a ZMQ endpoint"):
        serving_config({"kv_events_endpoint": "localhost:5557"})
    with pytest.raises(OSError, match="kv_events_endpoint 'tcp://nowhere'"):
        KVEventPublisher("tcp://nowhere", "", P, "CPU")
    with pytest.raises(ConfigError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        serving_config({"kv_events_replay_endpoint": "tcp://*:5558"})
    with pytest.raises(ConfigError, match="kv_events_replay_endpoint must be a ZMQ endpoint"):
        serving_config({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "5558"})
    with pytest.raises(OSError, match="kv_events_replay_endpoint 'tcp://nowhere'"):
        KVEventPublisher("tcp://*:0", "", P, "CPU", replay_endpoint="tcp://nowhere", replay_batches=1)
    with pytest.raises(ValueError, match="replay_batches >= 1"):
        KVEventPublisher("tcp://*:0", "", P, "CPU", replay_endpoint="tcp://*:0")


@pytest.mark.server
@pytest.mark.model
def test_a_served_prompt_s_pages_are_published(tmp_path):
    """A subscriber that binds (a central collector); the server connects to it and publishes the
    pages its prefix cache keeps of a request's prompt, which tile the prompt's tokens; its replay
    socket answers the same batches again."""
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    subscriber = Subscriber(bind=endpoint)
    server = TritonServer({"kv_events_endpoint": endpoint, "kv_events_topic": "kv@pod@icekv", "policy": "full",
                           "kv_events_replay_endpoint": replay_endpoint}, log_path=tmp_path / "triton.log")
    server.start()
    try:
        status, answer = post(server, "/v2/models/icekv/generate",
                              {"text_input": "The lighthouse keeper wrote in his log every night. " * 8,
                               "max_tokens": 4})
        assert status == 200
        pages = answer["prompt_tokens"] // 16

        def stored(messages):
            return [e for e in _events(messages) if type(e).__name__ == "BlockStored"]

        messages = subscriber.until(lambda m: len(stored(m)) >= pages)
        replayed = [a[1:] for a in _replay(replay_endpoint, int.from_bytes(messages[0][1], "big"))[:-1]]
    finally:
        server.stop()
        subscriber.close()
    assert {m[0] for m in messages} == {b"kv@pod@icekv"}
    heard = set()
    for e in stored(messages):  # each page's parent heard before it
        assert e.parent_block_hash is None or e.parent_block_hash in heard
        assert len(e.token_ids) == 16 and e.block_size == 16 and e.medium == "CPU"
        heard.add(e.block_hashes[0])
    assert replayed[:len(messages)] == messages  # the same frames: topic, sequence number, payload
