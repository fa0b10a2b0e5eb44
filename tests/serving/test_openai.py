"""The OpenAI-compatible frontend with the official ``openai`` client, against a real tritonserver."""

import json
import urllib.error
import urllib.request

import openai
import pytest

from icekv.chat_template import ChatTemplate
from icekv.model import Tokenizer
from tests.serving.conftest import oversize_requests, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _raw(frontend, path, body: bytes | None = None, method=None):
    """(status, parsed JSON) of a request sent as is."""
    req = urllib.request.Request(f"{frontend.url}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["icekv"]


def test_chat_completion_applies_the_template_and_counts_usage(client, smollm2_dir):
    reply = client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=12)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"  # the template's end-of-turn token ends the answer
    prompt = ChatTemplate.load(smollm2_dir).render(QUESTION)
    assert reply.usage.prompt_tokens == len(Tokenizer(smollm2_dir).encode(prompt))
    completion_ids = Tokenizer(smollm2_dir).encode(choice.message.content)
    assert reply.usage.completion_tokens in (len(completion_ids), len(completion_ids) + 1)  # + the end-of-turn token
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_the_whole_answer_and_reports_usage(client):
    whole = client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=12).choices[0].message.content
    chunks = list(client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_with_stop_and_max_tokens(client):
    reply = client.completions.create(model="icekv", prompt="The capital of France is", max_tokens=8)
    assert reply.choices[0].text.startswith(" Paris") and reply.usage.prompt_tokens == 5
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    stopped = client.completions.create(model="icekv", prompt="The capital of France is", max_tokens=8, stop=["."])
    assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="icekv", prompt="The capital of France is", max_tokens=8, stream=True)]
    assert "".join(pieces) == reply.choices[0].text


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="icekv", prompt="My favourite animal is the", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_icekv_settings_as_extra_body_fields(client):
    reply = client.completions.create(model="icekv", prompt="The capital of France is", max_tokens=4,
                                      extra_body={"policy": "quest", "budget": 64})
    assert reply.model_extra["icekv"]["policy"] == "quest" and reply.model_extra["icekv"]["budget"] == 64


def test_a_shared_document_as_an_extra_body_context(client, essays_text):
    words = essays_text.split()[8000:8500]
    words.insert(250, "One of the special magic numbers for tidy-walrus is: 6620184.")
    extra = {"context": " ".join(words), "kv_method": "snapkv", "kv_budget": 1.0, "policy": "full"}
    prompt = ("\nWhat is the special magic number for tidy-walrus mentioned in the provided text? "
              "The special magic number for tidy-walrus mentioned in the provided text is")
    first = client.completions.create(model="icekv", prompt=prompt, max_tokens=8, extra_body=extra)
    stats = first.model_extra["icekv"]
    assert stats["context_cache"] == "compressed" and len(stats["context_key"]) == 64
    assert "6620184" in first.choices[0].text
    assert first.usage.prompt_tokens < 60  # the document is not re-sent through the model
    chunks = list(client.completions.create(model="icekv", prompt=prompt, max_tokens=8, stream=True,
                                            extra_body=extra))
    last = chunks[-1].model_extra["icekv"]
    assert last["context_cache"] == "hit" and last["context_key"] == stats["context_key"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    by_key = client.completions.create(model="icekv", prompt=prompt, max_tokens=8,
                                       extra_body={"context_key": stats["context_key"], "policy": "full"})
    assert by_key.choices[0].text == first.choices[0].text


def test_penalties_and_logit_bias_change_the_tokens_as_defined_and_nothing_at_zero(client, smollm2_dir):
    ask = lambda **kw: client.completions.create(model="icekv", prompt="Repeat: the the the the the the",  # noqa: E731
                                                 max_tokens=6, **kw).choices[0].text
    plain = ask()
    assert plain.count(" the") >= 3  # the model repeats it ...
    assert ask(presence_penalty=0, frequency_penalty=0, extra_body={"repetition_penalty": 1.0}) == plain
    assert ask(frequency_penalty=2, presence_penalty=2).count(" the") < plain.count(" the")  # ... unless penalised
    assert ask(extra_body={"repetition_penalty": 3.0}).count(" the") < plain.count(" the")
    banana = Tokenizer(smollm2_dir).encode(" banana")[0]
    assert ask(logit_bias={str(banana): 100}) == " banana" * 6


def test_a_ten_turn_chat_holds_its_earlier_turns_and_answers_as_without_them(client):
    messages, cached, prompts = [], [], []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn + 1}: name one colour of the rainbow."})
        reply = client.chat.completions.create(model="icekv", messages=messages, max_tokens=8)
        fresh = client.chat.completions.create(model="icekv", messages=messages, max_tokens=8,
                                               extra_body={"cache_prompt": False})
        assert reply.choices[0].message.content == fresh.choices[0].message.content
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        prompts.append(reply.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    for turn in range(1, 10):  # each turn holds at least the pages of the turn before's prompt
        assert cached[turn] >= prompts[turn - 1] // 16 * 16 - 16, (turn, cached, prompts)


@pytest.mark.parametrize("kwargs, param, message", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "Input should be"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": QUESTION, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"messages": QUESTION, "n": 17}, "n", "less than or equal to 16"),
    ({"messages": QUESTION, "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": QUESTION, "top_logprobs": 2}, None, "top_logprobs needs logprobs"),
    ({"messages": QUESTION, "logit_bias": {"x": 1}}, None, "logit_bias keys must be token ids"),
    ({"messages": QUESTION, "logit_bias": {"99999999": 1}}, None, "vocabulary has 49152 tokens"),
    ({"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences"),
    ({"messages": QUESTION, "extra_body": {"budget": 2**31}}, "budget", "less than or equal to 2147483647"),
    ({"messages": QUESTION, "extra_body": {"colour": "red"}}, "colour", "unrecognized request argument"),
    ({"messages": QUESTION, "extra_body": {"policy": "nope"}}, None, "unknown policy 'nope'"),
    ({"messages": QUESTION, "extra_body": {"context_key": "ab" * 32}}, None, "unknown context_key"),
    ({"messages": QUESTION, "max_tokens": 100_000}, None, "exceeds this server's limit"),
    ({"messages": QUESTION, "extra_body": {"context": "a document", "kv_budget": 0}}, "kv_budget", "greater than 0"),
    ({"messages": QUESTION, "extra_body": {"context": "a document", "kv_method": "zip"}}, None,
     "unknown kv_method 'zip'"),
    ({"messages": QUESTION, "extra_body": {"kv_method": "kv2"}}, None, "kv_method applies only to a request with"),
    ({"messages": QUESTION, "extra_body": {"context_key": "zz" * 32}}, None, "invalid context_key"),
    ({"messages": QUESTION, "extra_body": {"cache_prompt": "no"}}, "cache_prompt", "valid boolean"),
    ({"messages": QUESTION, "extra_body": {"cache_retention_s": -1}}, "cache_retention_s", "greater than or equal to 0"),
    ({"messages": QUESTION, "extra_body": {"cache_retention_s": 1e6}}, None, "(max_cache_retention_s)"),
])
def test_bad_requests_get_openai_shaped_400s(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="icekv", **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert message in error["message"] and error["param"] == param
    assert "Traceback" not in error["message"] and "/" not in error["message"]


def test_unknown_model_malformed_and_oversize_bodies(client, openai_frontend):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    status, body = _raw(openai_frontend, "/v1/chat/completions", b'{"model": "icekv", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _raw(openai_frontend, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    for status, body in oversize_requests(openai_frontend, "/v1/completions", limit=1 << 20):
        assert status == 413 and "exceeds this server's limit of 1048576 bytes" in body["error"]["message"]
    status, body = _raw(openai_frontend, "/v1/nothing", b"{}")
    assert status == 404 and body["error"]["message"] == "no route /v1/nothing"
    status, body = _raw(openai_frontend, "/v1/models", b"{}", method="DELETE")
    assert status == 405 and "DELETE" in body["error"]["message"]


def test_a_disconnect_mid_stream_frees_the_request(client, server):
    before = wait_idle(server)["icekv_requests_cancelled_total"]
    stream = client.chat.completions.create(
        model="icekv", messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=1000, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    idle = wait_idle(server)  # no request running, no pages held
    assert idle["icekv_requests_cancelled_total"] == before + 1  # cancelled, not run to its 1000 tokens


def test_a_disconnect_before_the_answer_cancels_it(openai_frontend, server):
    before = wait_idle(server)["icekv_requests_cancelled_total"]
    body = json.dumps({"model": "icekv", "max_tokens": 1000,
                       "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}).encode()
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(urllib.request.Request(f"{openai_frontend.url}/v1/chat/completions", data=body),
                               timeout=2)
    idle = wait_idle(server)
    assert idle["icekv_requests_cancelled_total"] == before + 1


def test_health_follows_the_triton_model(openai_frontend):
    status, body = _raw(openai_frontend, "/health")
    assert status == 200 and body == {"status": "ok"}
