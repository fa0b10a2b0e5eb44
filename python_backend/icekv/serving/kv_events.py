"""The prefix cache's page events on a ZMQ socket, in vLLM's KV-events wire format, for the routers
that send a request where its prefix is cached (llm-d's KV-cache indexer, Dynamo's KV router).

Each message has three frames: the topic, a sequence number (8 bytes, big-endian, from 0 in each
process) and a msgpack batch ``[ts, [event, ...]]``. An event is a map tagged by its ``type``:
``BlockStored`` (one page: its chain key as ``block_hashes``, its parent's key, its tokens, the
page size), ``BlockRemoved`` (evicted keys) or ``AllBlocksCleared``, sent first, since a new process
holds nothing (only subscribers already connected hear it: there is no replay). A page's key is
icekv's own chain hash (16 bytes); consumers that key prefixes by their tokens read ``token_ids``
and ``parent_block_hash``. Events are gathered on the engine's thread and sent in one batch every
``period_s`` by a thread of their own, which alone uses the socket.
"""

from __future__ import annotations

import logging
import threading
import time
from itertools import count

import msgspec
import zmq

log = logging.getLogger(__name__)


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

    def __init__(self, endpoint: str, topic: str, page_size: int, medium: str, period_s: float = 0.05):
        self.page_size, self.medium, self.period_s = page_size, medium, period_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        try:
            self._socket.bind(endpoint) if is_bind_endpoint(endpoint) else self._socket.connect(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            self._context.term()
            raise OSError(f"kv_events_endpoint {endpoint!r}: {e}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint  # a bound port 0: the real one
        self._topic = topic.encode()
        self._pending: list = [AllBlocksCleared()]
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._sequence, self._encoder = count(), msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="icekv-kv-events", daemon=True)
        self._thread.start()

    def stored(self, key: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        event = BlockStored([key], parent, token_ids, self.page_size, None, self.medium, None)
        with self._lock:
            self._pending.append(event)

    def removed(self, keys: list[bytes]) -> None:
        with self._lock:
            self._pending.append(BlockRemoved(list(keys), self.medium))

    def close(self) -> None:
        """Send what is pending, then close the socket."""
        self._stop.set()
        self._thread.join()
        self._send()
        self._socket.close(linger=1000)
        self._context.term()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._send()
            except Exception:  # a batch lost, not the ones after it
                log.exception("publishing KV events failed")

    def _send(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if events:
            payload = self._encoder.encode(EventBatch(time.time(), events))
            self._socket.send_multipart((self._topic, next(self._sequence).to_bytes(8, "big"), payload))
