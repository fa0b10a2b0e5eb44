"""A real tritonserver with the icekv model on 127.0.0.1, shared by the serving tests."""

import json
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.launcher import TritonServer, free_port
from icekv.serving.openai.process import OpenAIFrontendProcess
from icekv.serving.engine_loop import TICK_S

POOL_TOKENS = 8192
MAX_COMPRESS_TOKENS = 4096


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    store = tmp_path_factory.mktemp("contexts")
    srv = TritonServer({"pool_tokens": str(POOL_TOKENS), "max_active_requests": "4", "store": str(store),
                        "max_compress_tokens": str(MAX_COMPRESS_TOKENS)},
                       log_path=log)
    srv.store_dir = store
    srv.start()
    stubs = stub_pids(srv)
    yield srv
    srv.stop()
    # Triton unloads the model within its exit timeout: nothing the tests did (cancellations,
    # disconnects, errors, the frontend's streams) may keep a request or the model alive
    assert srv.process.returncode == 0, f"tritonserver did not stop cleanly:\n{srv.log_tail(5)}"
    # and the model's process exits without crashing (Triton's exit status does not tell)
    crashes = stub_crashes(stubs)
    assert not crashes, f"the Python backend's stub crashed:\n{crashes}"


def stub_pids(server: TritonServer) -> list[str]:
    """The model's Python stub processes, in the server's process group."""
    return subprocess.run(["pgrep", "-g", str(server.process.pid), "-f", "triton_python_backend_stub"],
                          capture_output=True, text=True).stdout.split()


def stub_crashes(pids: list[str]) -> str:
    """The kernel log's segfault lines of the processes ``pids`` (a crash of their main thread, as
    in a teardown), or "" where there are none or the log cannot be read: a best-effort check."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    tags = tuple(f"[{pid}]: segfault" for pid in pids)
    return "\n".join(line for line in log.stdout.splitlines() if any(tag in line for tag in tags))


@pytest.fixture(scope="session")
def openai_frontend(server, tmp_path_factory):
    """The OpenAI-compatible frontend forwarding to ``server`` over gRPC (its own process)."""
    log = tmp_path_factory.mktemp("openai") / "frontend.log"
    config = OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port(), max_body_bytes=1 << 20)
    with OpenAIFrontendProcess(config, log_path=log) as frontend:
        yield frontend


@pytest.fixture(scope="session")
def openai_client(openai_frontend):
    """The official ``openai`` client of ``openai_frontend`` (no retries: a failure shows as it is)."""
    import openai
    return openai.OpenAI(base_url=f"{openai_frontend.url}/v1", api_key="unused", max_retries=0, timeout=300)


def post(server, path: str, body, timeout=300):
    """POST JSON (or raw bytes) -> (status, parsed JSON or SSE events)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")
    if path.endswith("generate_stream"):
        return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return status, json.loads(text)


def oversize_requests(frontend, path: str, limit: int) -> list[tuple[int, dict]]:
    """A body declared larger than ``limit`` (refused before it is sent), and one sent chunked
    without a length that runs past it: (status, JSON) of each."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(frontend.url)
    out = []
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.putrequest("POST", path)
    conn.putheader("Content-Length", str(2 * limit))
    conn.endheaders()  # no body: the answer must not wait for it
    r = conn.getresponse()
    out.append((r.status, json.loads(r.read())))
    conn.close()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", path, body=iter([b"x" * (limit + 1)]), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    r = conn.getresponse()
    out.append((r.status, json.loads(r.read())))
    conn.close()
    return out


def metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("icekv_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def wait_idle(server, timeout_s=120) -> dict[str, float]:
    """Metrics once no request is active or queued, the page pool is empty, and two reads more
    than two metrics ticks apart agree (counters of the last requests are pushed on a tick)."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while time.monotonic() < deadline:
        m = metrics(server)
        idle = m["icekv_active_requests"] == 0 and m["icekv_queued_requests"] == 0 and m["icekv_kv_host_bytes"] == 0
        if idle and m == previous:
            return m
        previous = m if idle else None
        time.sleep(2 * TICK_S + 0.1)
    raise AssertionError(f"server not idle: {metrics(server)}")
