"""A TCP pass-through in front of one replica that notes which conversation's turns it carried
(bench/replicas_routing.py registers each replica with the gateway behind one).

Bytes pass unchanged both ways, the response stream unbuffered. The tap reads the HTTP requests
going to its replica and notes each chat completion's conversation (the hash of its first user
message) and turn (its number of user messages). Stopping it refuses new connections and shuts
down the open ones towards the gateway, as a dead replica's sockets would.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 10.0


def first_user_key(messages: list) -> str | None:
    """A conversation's identity as the taps and the clients both compute it: the hash of its first
    user message (which carries the conversation's own document)."""
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return hashlib.sha1(str(content).encode()).hexdigest()
    return None


class RequestReader:
    """HTTP/1.1 requests out of one connection's client-to-server bytes (keep-alive: one after the
    other): (method, path, body) of each whole request, Content-Length or chunked bodies."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, str, bytes]]:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return out
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            request_line = lines[0].split(" ")
            headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
            start = end + 4
            if "chunked" in headers.get("transfer-encoding", "").lower():
                body, consumed = self._dechunk(start)
                if body is None:
                    return out
            else:
                n = int(headers.get("content-length", "0") or 0)
                if len(self.buf) < start + n:
                    return out
                body, consumed = bytes(self.buf[start:start + n]), start + n
            out.append((request_line[0], request_line[1] if len(request_line) > 1 else "", body))
            del self.buf[:consumed]

    def _dechunk(self, at: int) -> tuple[bytes | None, int]:
        body = bytearray()
        while True:
            eol = self.buf.find(b"\r\n", at)
            if eol < 0:
                return None, 0
            size = int(bytes(self.buf[at:eol]).split(b";")[0].strip() or b"0", 16)
            at = eol + 2
            if size == 0:  # trailers up to an empty line
                while True:
                    eol = self.buf.find(b"\r\n", at)
                    if eol < 0:
                        return None, 0
                    if eol == at:
                        return bytes(body), eol + 2
                    at = eol + 2
            if len(self.buf) < at + size + 2:
                return None, 0
            body += self.buf[at:at + size]
            at += size + 2


class Tap:
    """A TCP pass-through in front of replica ``index`` that notes the chat requests it carries
    (``events``: replica, conversation key, turn, time). Bytes go through unchanged and unbuffered."""

    def __init__(self, upstream_url: str, index: int, events: list, lock: threading.Lock):
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname, parts.port)
        self.index, self.events, self.lock = index, events, lock
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: set[socket.socket] = set()
        self.closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Tap":
        threading.Thread(target=self._accept, daemon=True, name=f"tap{self.index}").start()
        return self

    def stop_accepting(self) -> None:
        """As the replica's dead port: connections refused from now on."""
        self.closed = True
        try:  # shutdown wakes the blocked accept() and stops the listening (close alone would not on Linux)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.listener.close()
        except OSError:
            pass

    def stop(self) -> None:
        self.stop_accepting()
        with self.lock:
            live = list(self.sockets)
        for s in live:
            self._close(s)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.closed:
                self._close(client, reset=True)
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _close(self, s: socket.socket, reset: bool = False) -> None:
        """Shut down, then close: the peer sees the end at once, and a thread of ours blocked in
        recv() on ``s`` wakes (close() alone would leave the connection open while it waits)."""
        for step in (lambda: reset and s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
                     lambda: s.shutdown(socket.SHUT_RDWR), s.close):
            try:
                step()
            except OSError:
                pass
        with self.lock:
            self.sockets.discard(s)

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=CONNECT_TIMEOUT_S)
        except OSError:  # the replica is gone: so is this port
            self._close(client, reset=True)
            return
        upstream.settimeout(None)
        with self.lock:
            self.sockets.update((client, upstream))
        threading.Thread(target=self._back, args=(upstream, client), daemon=True).start()
        reader = RequestReader()

        def note(data: bytes) -> None:
            for request in reader.feed(data):
                self._note(*request)

        _pump(client, upstream, note)
        self._close(upstream)
        self._close(client)

    def _back(self, upstream: socket.socket, client: socket.socket) -> None:
        """The replica's bytes to the gateway; when the replica's side ends (closed, reset or killed),
        the gateway's side ends too."""
        _pump(upstream, client)
        self._close(client)
        self._close(upstream)

    def _note(self, method: str, path: str, body: bytes) -> None:
        if method != "POST" or not path.split("?")[0].endswith("/chat/completions"):
            return
        try:
            messages = json.loads(body).get("messages", [])
        except (ValueError, AttributeError):
            messages = []
        event = {"replica": self.index, "key": first_user_key(messages),
                 "turn": sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user"),
                 "t": time.monotonic()}
        with self.lock:
            self.events.append(event)


def _pump(source: socket.socket, sink: socket.socket, seen=lambda data: None) -> None:
    """``source``'s bytes to ``sink`` as they come (each chunk shown to ``seen``), until either side ends."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
            seen(data)
    except OSError:
        pass
