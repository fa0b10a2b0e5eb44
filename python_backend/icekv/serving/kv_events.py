"""The prefix cache's page events on a ZMQ socket, in vLLM's KV-events wire format, for the routers
that send a request where its prefix is cached (llm-d's KV-cache indexer, Dynamo's KV router).

Each message has three frames: the topic, a sequence number (8 bytes, big-endian, from 0 in each
process) and a msgpack batch ``[ts, [event, ...]]``. An event is a map tagged by its ``type``:
``BlockStored`` (one page: its chain key as ``block_hashes``, its parent's key, its tokens, the
page size), ``BlockRemoved`` (evicted keys) or ``AllBlocksCleared``, sent first, since a new process
holds nothing. A page's key is icekv's own chain hash (16 bytes); consumers that key prefixes by
their tokens read ``token_ids`` and ``parent_block_hash``. Events are gathered on the engine's
thread and sent in one batch every ``period_s`` by a thread of their own, which alone uses the
sockets.

A subscriber that connected late or lost messages (a gap in the sequence numbers) asks the replay
socket, when there is one, for the batches from a sequence number on, as vLLM's publisher answers
it: a ROUTER socket takes ``[empty, start (8 bytes, big-endian)]`` from a DEALER and answers each
kept batch numbered ``start`` or later as ``[empty, topic, sequence, payload]``, then
``[empty, empty, -1 (8 bytes, signed), empty]``. The last ``replay_batches`` batches are kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

log = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the sequence number that ends a replay


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def is_bind_endpoint(endpoint: str) -> bool:
    """A wildcard host (``*``, ``::``, ``0.0.0.0``) or an ipc path is bound; any other address is
    connected to (vLLM's rule, with ``0.0.0.0`` bound too)."""
    return any(w in endpoint for w in ("*", "::", "//0.0.0.0:")) or endpoint.startswith("ipc://")


class KVEventPublisher:
    """Hears the prefix cache's pages (:class:`icekv.kv.prefix_cache.PageEvents`) and publishes
    them on ``endpoint`` under ``topic``; ``medium`` names where the pool lives ("CPU" or "GPU")."""

    def __init__(self, endpoint: str, topic: str, page_size: int, medium: str, period_s: float = 0.05,
                 replay_endpoint: str | None = None, replay_batches: int = 0):
        """``replay_endpoint``: where the replay socket binds (None: no replay), answering from the
        last ``replay_batches`` batches (the server's ``kv_events_replay_batches``)."""
        if replay_endpoint is not None and replay_batches < 1:
            raise ValueError("a replay socket needs replay_batches >= 1")
        self.page_size, self.medium, self.period_s = page_size, medium, period_s
        self._context = zmq.Context()
        try:
            self._socket = self._open(zmq.PUB, endpoint, "kv_events_endpoint", is_bind_endpoint(endpoint))
            self._replay = (None if replay_endpoint is None
                            else self._open(zmq.ROUTER, replay_endpoint, "kv_events_replay_endpoint", True,
                                            send_limit=replay_batches + 1))  # a ROUTER drops what passes it
        except OSError:
            self._context.destroy(linger=0)  # closes whichever socket opened
            raise
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint  # a bound port 0: the real one
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)  # (sequence, payload), oldest first
        self._topic = topic.encode()
        self._pending: list = [AllBlocksCleared()]
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._sequence, self._encoder = count(), msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="icekv-kv-events", daemon=True)
        self._thread.start()

    def _open(self, kind: int, endpoint: str, setting: str, bind: bool, send_limit: int | None = None) -> zmq.Socket:
        """A socket of ``kind`` bound to or connected to ``endpoint`` (``send_limit``: messages it
        queues per peer, zmq's SNDHWM); OSError naming ``setting``."""
        socket = self._context.socket(kind)
        if send_limit is not None:
            socket.setsockopt(zmq.SNDHWM, send_limit)
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as e:
            raise OSError(f"{setting} {endpoint!r}: {e}") from None
        return socket

    def stored(self, key: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        event = BlockStored([key], parent, token_ids, self.page_size, None, self.medium, None)
        with self._lock:
            self._pending.append(event)

    def removed(self, keys: list[bytes]) -> None:
        with self._lock:
            self._pending.append(BlockRemoved(list(keys), self.medium))

    def close(self) -> None:
        """Send what is pending, then close the sockets."""
        self._stop.set()
        self._thread.join()
        self._send()
        if self._replay is not None:
            self._replay.close(linger=0)
        self._socket.close(linger=1000)
        self._context.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            deadline = time.monotonic() + self.period_s
            while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                if self._replay is None:
                    self._stop.wait(left)
                    continue
                try:
                    if self._replay.poll(max(1, int(left * 1000))):
                        self._answer_replay()
                except Exception:  # one request unanswered, never the events
                    log.exception("KV events: a replay request failed")
            try:
                self._send()
            except Exception:  # a batch lost, not the ones after it
                log.exception("publishing KV events failed")

    def _send(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if events:
            payload = self._encoder.encode(EventBatch(time.time(), events))
            sequence = next(self._sequence)
            self._socket.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            self._kept.append((sequence, payload))

    def _answer_replay(self) -> None:
        """One replay request: the kept batches from its sequence number on, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored (expected [empty, 8-byte start])",
                        len(frames) - 1)
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in self._kept:
            if sequence >= first:
                self._replay.send_multipart((client, b"", self._topic, sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
