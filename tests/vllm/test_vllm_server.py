"""icekv inside vLLM's own OpenAI server (the CPU build, `make setup-vllm`), as a user starts it:
the server's settings from --additional-config, a request's own through ``vllm_xargs``; tokens
equal to icekv's engine under the same plan; a bad setting answered 400 in vLLM's error shape; a
stream the client drops leaves no index behind. One server for the module, with vLLM's dev
endpoint on so the test can read icekv's state (``/collective_rpc``)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: `make setup-vllm` makes it")]
START_S = 600


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_dir),
             "--served-model-name", "smol", "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048",
             "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
             "--worker-cls", "icekv.vllm.worker.IceKVCPUWorker",
             "--additional-config", json.dumps({"icekv": {"policy": "icecache", "budget": 128}})],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while call(port, "GET", "/health")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield port
    finally:  # the server and its engine process, a session of their own
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    """(status, JSON body); (0, None) while nothing listens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    except (ConnectionError, OSError):
        return 0, None
    finally:
        conn.close()


def complete(port: int, ids: list[int], **extra) -> tuple[int, dict]:
    return call(port, "POST", "/v1/completions", {"model": "smol", "prompt": ids, "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True, **extra})


def icekv_stats(port: int) -> dict:
    status, body = call(port, "POST", "/collective_rpc", {"method": "icekv_stats"})
    assert status == 200, body
    return body["results"][0]


@pytest.fixture(scope="module")
def prompt(engine, essays_text):
    return engine.tokenizer.encode(essays_text)[2000:2700]  # past the budget: decodes select


def engine_tokens(engine, ids, selection: SelectionConfig) -> list[int]:
    return engine.generate(ids, SamplingConfig(max_tokens=16, ignore_eos=True), selection=selection).token_ids


def test_the_server_decodes_icekvs_tokens_under_its_settings_and_a_requests_own(server, engine, prompt):
    status, body = complete(server, prompt)
    assert status == 200, body
    icecache = body["choices"][0]["token_ids"]
    assert icecache == engine_tokens(engine, prompt, SelectionConfig(policy="icecache", budget=128))
    status, body = complete(server, prompt, vllm_xargs={"policy": "full"})
    assert status == 200, body
    full = body["choices"][0]["token_ids"]
    assert full == engine_tokens(engine, prompt, SelectionConfig(policy="full")) and full != icecache
    complete(server, prompt[:50], max_tokens=1)  # a step after theirs, in which the worker hears they finished
    assert icekv_stats(server)["indexes"] == 0


@pytest.mark.parametrize("xargs, names", [({"policy": "magic"}, "unknown policy 'magic'"),
                                          ({"budget": 0}, "budget must be >= 1"),
                                          ({"policy": "snapkv"}, "not available inside vLLM")])
def test_a_setting_icekv_cannot_run_is_answered_400_naming_it(server, prompt, xargs, names):
    status, body = complete(server, prompt[:50], vllm_xargs=xargs)
    assert status == 400, body
    message = body["error"]["message"]
    assert names in message and "Traceback" not in message and str(ROOT) not in message
    assert complete(server, prompt[:50])[0] == 200  # the server serves on


def test_a_dropped_stream_leaves_no_index(server, prompt):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"model": "smol", "prompt": prompt, "max_tokens": 1000,
                                                        "temperature": 0, "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    chunks = 0
    while chunks < 8:  # its first tokens: it selects from its second decode step
        line = response.readline()
        assert line and b'"error"' not in line, f"the stream ended early: {line!r}"
        chunks += line.startswith(b"data: {")
    assert icekv_stats(server)["indexes"] == 1
    conn.close()  # the client goes away mid-stream: vLLM aborts the request
    deadline = time.monotonic() + 60
    while icekv_stats(server)["indexes"] != 0:
        assert time.monotonic() < deadline, "the dropped stream's index was never freed"
        complete(server, prompt[:50], max_tokens=2)  # steps, in which the worker hears of the abort
    assert complete(server, prompt[:50])[0] == 200
