"""The launcher cleans up after a tritonserver that died: tritonserver 2.51 dies with SIGSEGV on a
generate body past ~4 MiB (why icekv serve keeps its HTTP on loopback), and its Python stub, left
behind, would keep the model's memory until the container ends."""

import json
import time
import urllib.error
import urllib.request

import pytest

from icekv.serving.launcher import TritonServer
from tests.serving.conftest import stub_pids

pytestmark = [pytest.mark.server, pytest.mark.model]


def _state(pid: str) -> str:
    try:
        return next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("State"))
    except FileNotFoundError:
        return "gone"


def test_a_crashed_server_leaves_no_stub_running(smollm2_dir):
    server = TritonServer({"pool_tokens": "4096"}).start()
    stubs = stub_pids(server)
    assert stubs, "the model's Python stub runs in the server's process group"
    body = json.dumps({"text_input": "a" * 4_500_000}).encode()  # reaches tritonserver's own HTTP
    with pytest.raises(OSError):
        urllib.request.urlopen(urllib.request.Request(f"http://{server.http_url}/v2/models/icekv/generate",
                                                      data=body), timeout=120)
    deadline = time.monotonic() + 30
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.process.returncode is not None and server.process.returncode != 0  # it did die
    server.stop()
    deadline = time.monotonic() + 10
    while any(_state(pid) not in ("Z", "gone") for pid in stubs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_state(pid) in ("Z", "gone") for pid in stubs)  # killed (a zombie until init reaps it)


def test_the_model_unloads_after_many_requests_through_the_frontend(smollm2_dir):
    """Cancelling a gRPC stream after its decoupled request has completed (with an answer or with
    an error) leaks the call's state in tritonserver 2.51, and the model then never unloads
    (shutdown hits its exit timeout); the frontend's bridge and the client cancel only unfinished
    calls."""
    from icekv.serving.openai.config import OpenAIConfig
    from icekv.serving.client import GenerateError, stream_generate
    from icekv.serving.launcher import free_port
    from icekv.serving.openai.process import OpenAIFrontendProcess

    server = TritonServer({"pool_tokens": "4096"}).start()
    try:
        with OpenAIFrontendProcess(OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port())) as frontend:
            for i in range(20):
                refused = i % 2 == 1  # the model answers with an error at once
                body = json.dumps({"text_input": "Hi", "max_tokens": 2, **({"policy": "nope"} if refused else {})}).encode()
                request = urllib.request.Request(f"{frontend.url}/v2/models/icekv/generate", data=body)
                try:
                    with urllib.request.urlopen(request, timeout=120) as r:
                        assert not refused and r.status == 200
                except urllib.error.HTTPError as e:
                    assert refused and e.code == 400
            time.sleep(1)  # the frontend's calls are over before it stops
        for i in range(10):
            refused = i % 2 == 1
            try:
                pieces = list(stream_generate(server.grpc_url, "Hi", max_tokens=2, **({"policy": "nope"} if refused else {})))
                assert not refused and pieces
            except GenerateError:
                assert refused
    finally:
        server.stop()
    assert server.process.returncode == 0, server.log_tail(5)

