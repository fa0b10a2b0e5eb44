"""OpenAI's many-answer and scoring features with the official ``openai`` client, against a real
tritonserver: ``n`` choices sharing one prefill, lists of prompts, logprobs and echo."""

import openai
import pytest

from tests.serving.conftest import POOL_TOKENS, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def test_logprobs_in_openais_shapes(client):
    chat = client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=6, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the likeliest
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    plain = client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content
    stream = list(client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=6, logprobs=True,
                                                 stream=True))
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # the second request holds the first's cached prompt pages: its prefill runs in other chunks
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    text = client.completions.create(model="icekv", prompt="The capital of France is", max_tokens=4, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_n_choices_share_one_prefill_and_count_the_prompt_once(client, server):
    prompt = "The river Thames flows through London. " * 25
    before = wait_idle(server)
    reply = client.completions.create(model="icekv", prompt=prompt, max_tokens=6, n=3)
    after = wait_idle(server)
    single = client.completions.create(model="icekv", prompt=prompt, max_tokens=6, extra_body={"cache_prompt": False})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.text for c in reply.choices} == {single.choices[0].text}  # greedy: three times the same answer
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * single.usage.completion_tokens
    held = after["icekv_prefix_cache_hit_tokens_total"] - before["icekv_prefix_cache_hit_tokens_total"]
    assert held >= 2 * (single.usage.prompt_tokens - 32)  # choices 1 and 2 prefilled at most a page and a token
    sampled = lambda: [c.message.content for c in client.chat.completions.create(  # noqa: E731
        model="icekv", messages=QUESTION, max_tokens=12, n=3, temperature=1.0, seed=7).choices]
    first = sampled()
    assert sampled() == first and len(set(first)) > 1  # each choice its own seed: different, and repeatable
    chunks = list(client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=8, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    whole = client.chat.completions.create(model="icekv", messages=QUESTION, max_tokens=8, n=2)
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_list_of_prompts_is_answered_in_order_each_as_alone(client):
    prompts = ["The capital of France is", "The capital of Italy is", "Two plus two is"]
    alone = [client.completions.create(model="icekv", prompt=p, max_tokens=5) for p in prompts]
    together = client.completions.create(model="icekv", prompt=prompts, max_tokens=5, n=2)
    assert [c.index for c in together.choices] == list(range(6))
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    unshared = client.completions.create(model="icekv", prompt=prompts, max_tokens=5, n=2,
                                         extra_body={"cache_prompt": False})  # every choice starts at once
    assert [c.text for c in unshared.choices] == [c.text for c in together.choices]
    streamed = ["" for _ in range(6)]
    for chunk in client.completions.create(model="icekv", prompt=prompts, max_tokens=5, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in together.choices]


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ["a"] * 17}, "send 1 to 16 prompts, got 17"),
    ({"prompt": []}, "send 1 to 16 prompts, got 0"),
    ({"prompt": ["a", " "]}, "prompt is empty"),
    ({"prompt": ["a"] * 5, "n": 4}, "at most 16 choices, got 20"),
])
def test_bad_prompt_lists_get_400s(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="icekv", max_tokens=2, **kwargs)
    assert message in info.value.body["message"]


def test_echo_returns_the_prompt_and_with_logprobs_scores_it(client):
    prompt = "The capital of France is"
    scored = client.completions.create(model="icekv", prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == scored.usage.prompt_tokens + scored.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = client.completions.create(model="icekv", prompt=prompt, max_tokens=2, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="icekv", prompt=prompt, max_tokens=2, echo=True, stream=True) if c.choices)
    assert streamed == choice.text


def test_a_refused_prompt_in_a_list_fails_the_request_and_ends_the_others(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="icekv", prompt=["The capital of France is", "word " * (POOL_TOKENS + 10)],
                                  max_tokens=2000)
    assert "exceeds the KV cache capacity" in info.value.body["message"]
    wait_idle(server, timeout_s=20)  # nothing left running: the first prompt's request is not decoding 2,000 tokens