"""vLLM-named series derived from icekv's metrics (what endpoint pickers read), and the SGLang
Model Gateway's added body fields accepted at their neutral values."""

import json

import pytest

from icekv.serving.openai.engine_metrics import VLLM_METRICS, sample_values, vllm_exposition
from icekv.serving.openai.protocol import ChatCompletionBody, CompletionBody, OpenAIError, parse_body

TRITON_TEXT = """# HELP icekv_active_requests requests being prefilled or decoded
# TYPE icekv_active_requests gauge
icekv_active_requests{model="icekv"} 3
icekv_queued_requests{model="icekv"} 2
icekv_kv_pool_pages{model="icekv"} 2048
icekv_kv_pool_pages_in_use{model="icekv"} 512
icekv_prefix_cache_hit_tokens_total{model="icekv"} 900
icekv_prefix_cache_miss_tokens_total{model="icekv"} 100
nv_inference_count{model="icekv",version="1"} 7
nv_inference_count{model="other",version="1"} 5
nv_weird{label="a } b"} 4 1712345678
not a sample line
nv_nan NaN
"""


def test_samples_are_read_and_summed_over_label_sets():
    values = sample_values(TRITON_TEXT)
    assert values["icekv_active_requests"] == 3
    assert values["nv_inference_count"] == 12  # two label sets
    assert values["nv_weird"] == 4  # a brace inside a label, a timestamp after the value
    assert "nv_nan" not in values and "not" not in values


def test_vllm_names_carry_the_served_model_and_the_icekv_values():
    text = vllm_exposition(TRITON_TEXT, 'my "model"')
    samples = {line.split("{")[0]: line for line in text.splitlines() if not line.startswith("#")}
    assert set(samples) == {m.name for m in VLLM_METRICS}
    assert samples["vllm:num_requests_running"].endswith("} 3.0")
    assert samples["vllm:num_requests_waiting"].endswith("} 2.0")
    assert samples["vllm:kv_cache_usage_perc"].endswith("} 0.25")
    assert samples["vllm:prefix_cache_queries_total"].endswith("} 1000.0")
    assert samples["vllm:prefix_cache_hits_total"].endswith("} 900.0")
    assert all('{model_name="my \\"model\\""}' in line for line in samples.values())
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert types["vllm:num_requests_waiting"] == "gauge" and types["vllm:prefix_cache_hits_total"] == "counter"


def test_a_series_whose_sources_are_missing_is_left_out():
    assert vllm_exposition("", "icekv") == ""
    text = vllm_exposition('icekv_kv_pool_pages{model="icekv"} 0\nicekv_kv_pool_pages_in_use{model="icekv"} 0\n',
                           "icekv")
    assert text.count("# TYPE") == 1 and 'vllm:kv_cache_usage_perc{model_name="icekv"} 0.0' in text


# what the SGLang Model Gateway (sglang-router 0.3) sends for a plain chat and a plain completion
GATEWAY_CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "model": "icekv", "logprobs": False,
                "max_completion_tokens": 4, "stream": False, "no_stop_trim": False, "ignore_eos": False,
                "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                "stream_reasoning": True, "return_hidden_states": False}
GATEWAY_COMPLETION = {"model": "icekv", "prompt": "Say hi", "max_tokens": 4, "stream": False, "echo": False,
                      "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                      "return_hidden_states": False}


def test_the_gateways_bodies_are_accepted_and_ask_for_nothing_more():
    chat = parse_body(ChatCompletionBody, json.dumps(GATEWAY_CHAT).encode(), 4)
    plain = parse_body(ChatCompletionBody, json.dumps({"model": "icekv", "messages": GATEWAY_CHAT["messages"],
                                                       "max_tokens": 4}).encode(), 4)
    assert chat.triton_fields() == plain.triton_fields()
    completion = parse_body(CompletionBody, json.dumps(GATEWAY_COMPLETION).encode(), 4)
    assert completion.triton_fields() == {"max_tokens": 4, "stream": True, "text_input": "Say hi"}


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("no_stop_trim", True), ("skip_special_tokens", False),
                                          ("return_hidden_states", True), ("continue_final_message", True)])
def test_a_gateway_field_asking_for_more_is_refused_by_name(field, value):
    with pytest.raises(OpenAIError) as refused:
        parse_body(ChatCompletionBody, json.dumps({**GATEWAY_CHAT, field: value}).encode(), 4)
    assert refused.value.status == 400 and refused.value.param == field
    assert refused.value.message.startswith(f"{field}: icekv supports only")


def test_chat_only_gateway_fields_are_not_completion_fields():
    with pytest.raises(OpenAIError, match="unrecognized request argument: continue_final_message"):
        parse_body(CompletionBody, json.dumps({**GATEWAY_COMPLETION, "continue_final_message": False}).encode(), 4)
