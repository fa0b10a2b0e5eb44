"""Triton's generate extension served by icekv's frontend (what clients reach on icekv serve's
HTTP port): the same answers as tritonserver's own endpoint, bodies bounded before they are read,
inputs type-checked with 400s that name the field, against a real tritonserver."""

import urllib.error
import urllib.request

import pytest

from tests.serving.conftest import oversize_requests, post

pytestmark = [pytest.mark.server, pytest.mark.model]
GEN = "/v2/models/icekv/generate"


class Front:
    def __init__(self, frontend):
        self.http_url = frontend.url.removeprefix("http://")


@pytest.fixture(scope="module")
def front(openai_frontend):
    return Front(openai_frontend)


def _get(target, path):
    try:
        with urllib.request.urlopen(f"http://{target.http_url}{path}", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_generate_answers_as_tritonserver_does(front, server):
    body = {"text_input": "The capital of France is", "max_tokens": 6, "parameters": {"policy": "full"}}
    status, mine = post(front, GEN, body)
    status_direct, direct = post(server, GEN, body)
    assert status == status_direct == 200
    assert mine["text_output"] == direct["text_output"] and "Paris" in mine["text_output"]
    for key in ("finish_reason", "prompt_tokens", "new_tokens", "policy", "budget", "model_name"):
        assert mine[key] == direct[key], key


def test_generate_stream_sends_pieces_then_the_statistics(front):
    status, events = post(front, GEN + "_stream", {"text_input": "The capital of France is", "max_tokens": 6})
    assert status == 200 and len(events) >= 2
    assert all(e["model_name"] == "icekv" for e in events)
    assert "Paris" in "".join(e["text_output"] for e in events)
    assert events[-1]["finish_reason"] in ("stop", "length") and events[-1]["new_tokens"] >= 1


@pytest.mark.parametrize("body, status, message", [
    ({"text_input": "hi", "max_tokens": "ten"}, 400, "input max_tokens must be an int32"),
    ({"text_input": "hi", "budget": 2**31}, 400, "input budget must be an int32"),
    ({"text_input": "hi", "temperature": True}, 400, "input temperature must be a finite float32 number"),
    ({"text_input": "hi", "temperature": 1e39}, 400, "input temperature must be a finite float32 number"),
    ({"text_input": "hi", "stop": ["a", 3]}, 400, "input stop must be a string or a list of them"),
    ({"text_input": "hi", "colour": "red"}, 400, "unknown inputs ['colour']"),
    ({"text_input": "hi", "parameters": [1]}, 400, "parameters must be a JSON object"),
    ({"text_input": "hi", "parameters": {"max_token": 5}}, 400, "unknown parameters ['max_token']"),
    ({"text_input": "hi", "policy": "magic"}, 400, "unknown policy 'magic'"),
    ({"max_tokens": 4}, 400, "text_input"),
])
def test_bad_bodies_get_400s_that_name_the_field(front, body, status, message):
    got, out = post(front, GEN, body)
    assert got == status and message in out["error"], out


def test_oversize_and_malformed_bodies_are_refused_and_the_server_lives_on(front, openai_frontend):
    limit = openai_frontend.config.max_body_bytes
    for status, out in oversize_requests(openai_frontend, GEN, limit):
        assert status == 413 and f"limit of {limit} bytes" in out["error"], out
    status, out = post(front, GEN, b'{"text_input": "hi", ')
    assert status == 400 and "not valid JSON" in out["error"]
    status, out = post(front, "/v2/models/other/generate", {"text_input": "hi"})
    assert status == 404 and "unknown model 'other'" in out["error"]
    assert post(front, GEN, {"text_input": "Hi", "max_tokens": 2})[0] == 200


def test_a_health_request_is_answered_at_once_by_the_engine_thread_check(server):
    status, out = post(server, GEN, {"health": True})
    assert status == 200 and out["finish_reason"] == "healthy" and out["new_tokens"] == 0


def test_health_routes(front):
    assert _get(front, "/v2/health/live") == 200
    assert _get(front, "/v2/health/ready") == 200
    assert _get(front, "/v2/models/icekv/ready") == 200
    assert _get(front, "/v2/models/other/ready") == 404
