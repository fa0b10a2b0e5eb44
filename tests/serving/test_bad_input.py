"""Every kind of bad request gets a clear error, and the server keeps serving with nothing leaked."""

import http.client
import json

import pytest

from tests.serving.conftest import POOL_TOKENS, MAX_COMPRESS_TOKENS, post, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]
GEN = "/v2/models/icekv/generate"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": "  "}, "text_input is empty"),
        ({"text_input": "hi", "max_tokens": -2}, "max_tokens must be >= 1"),
        ({"text_input": "hi", "max_tokens": 10**6}, "exceeds this server's limit"),
        ({"text_input": "hi", "policy": "magic"}, "unknown policy 'magic'"),
        ({"text_input": "hi", "policy": "icecache", "budget": 32}, "must exceed sink + window"),
        ({"text_input": "hi", "policy": "icecache", "budget": 100}, "not a multiple of the page size"),
        ({"text_input": "hi", "top_p": 0}, "top_p must be in (0, 1]"),
        ({"text_input": "hi", "stop": ["s"] * 2000}, "at most 4 stop strings"),
        ({"text_input": "hi", "stop": ["s" * 5000]}, "at most 128 characters"),
        ({"text_input": "hi", "context_key": "ab" * 32}, f"unknown context_key '{'ab' * 32}'"),
        ({"text_input": "hi", "context_key": "../etc"}, "invalid context_key '../etc'"),
        ({"text_input": "hi", "context_key": "ab" * 150}, "expected 64 lowercase hex digits"),
        ({"text_input": "hi", "context": "word " * (MAX_COMPRESS_TOKENS + 10)}, "(max_compress_tokens)"),
        ({"text_input": "hi", "context": "a short document", "kv_method": "magic"}, "unknown kv_method 'magic'"),
        ({"text_input": "hi", "context": "a short document", "kv_budget": 0}, "kv_budget must be in (0, 1]"),
        ({"text_input": "hi", "context": "a short document", "kv_budget": 1.5}, "kv_budget must be in (0, 1]"),
        ({"text_input": "hi", "context": "a short document", "kv_budget": 1e-9}, "at least 1e-06, got 1e-09"),
        ({"text_input": "hi", "context": "a short document", "context_key": "ab" * 32}, "does not match the context"),
        ({"text_input": "hi", "context": "a", "context_ids": [1, 2]}, "send one of context"),
        ({"text_input": "hi", "context_ids": [1, 10**9]}, "context_ids must be token ids"),
        ({"text_input": "hi", "kv_method": "kv2"}, "kv_method applies only to a request with a context"),
        ({"context": "  "}, "context is empty"),
        ({"text_input": "hi", "context": "a new document", "policy": "quest"}, "cannot select over a compressed"),
        ({"text_input": "word " * (POOL_TOKENS + 10)}, "exceeds the KV cache capacity"),
    ],
)
def test_bad_request_is_a_400_with_a_message(server, body, message):
    status, out = post(server, GEN, body)
    assert status == 400, out
    assert message in out["error"]
    assert "Traceback" not in out["error"] and str(server.store_dir) not in out["error"]


@pytest.mark.parametrize("body", [
    {"text_input": "hi", "max_tokens": "ten"},
    {"text_input": "hi", "parameters": {"max_tokens": "ten"}},
    {"text_input": "hi", "temperature": "hot"},
    {"text_input": "hi", "cache_prompt": "yes"},
    {"text_input": 42},
])
def test_wrong_datatypes_are_refused(server, body):
    """Declared inputs are converted by Triton's HTTP frontend, which rejects a wrong JSON type
    itself (status 500, 'Unable to parse ...') before icekv sees the request."""
    status, out = post(server, GEN, body)
    assert status in (400, 500) and "parse" in out["error"].lower()


def test_malformed_json_is_refused(server):
    """Triton's HTTP frontend parses the body and answers 500 with the parser's message."""
    status, out = post(server, GEN, b'{"text_input": "hi", ')
    assert status in (400, 500) and "json" in out["error"].lower()


def test_client_disconnect_mid_stream_frees_pages(server):
    conn = http.client.HTTPConnection(server.http_url, timeout=60)
    body = json.dumps({"text_input": "The capital of France is " * 40, "max_tokens": 300, "stream": True})
    conn.request("POST", "/v2/models/icekv/generate_stream", body=body)
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data:")  # the first piece arrived
    conn.close()  # hang up mid-stream
    wait_idle(server, timeout_s=180)


def test_server_still_serves_after_bad_input(server):
    status, out = post(server, GEN, {"text_input": "The capital of France is", "max_tokens": 8})
    assert status == 200 and "Paris" in out["text_output"]
    wait_idle(server)


def test_admin_apis_need_the_admin_header(server):
    """Model configs (paths, settings), shared memory, repository control, statistics, trace and
    logging are closed to clients; inference, health and metadata stay open."""
    import urllib.error
    import urllib.request

    from icekv.serving.launcher import ADMIN_HEADER

    def get(path, method="GET", body=None, headers=None):
        req = urllib.request.Request(f"http://{server.http_url}{path}", data=body, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    for path, method, body in [("/v2/models/icekv/config", "GET", None), ("/v2/logging", "GET", None),
                               ("/v2/models/stats", "GET", None), ("/v2/trace/setting", "GET", None),
                               ("/v2/systemsharedmemory/status", "GET", None),
                               ("/v2/repository/index", "POST", b"{}")]:
        status, text = get(path, method, body)
        assert status in (401, 403), (path, status, text)
        assert str(server.store_dir) not in text
    status, text = get("/v2/models/icekv/config", headers={ADMIN_HEADER: server.admin_key})
    assert status == 200 and '"backend":"python"' in text.replace(" ", "")
    assert get("/v2/models/icekv")[0] == 200 and get("/v2/health/ready")[0] == 200
    assert post(server, GEN, {"text_input": "Hi", "max_tokens": 2})[0] == 200
