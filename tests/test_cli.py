"""The installed ``icekv`` console script, run as a user would."""

import json
import os
import subprocess
import sys

import pytest


def icekv(*args, timeout=600):
    exe = os.path.join(os.path.dirname(sys.executable), "icekv")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.model
def test_generate_json_answers_paris(smollm2_dir):
    proc = icekv("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    for key in ("prompt_tokens", "new_tokens", "prefill_s", "decode_s", "tpot_s"):
        assert key in out
    assert out["kv"]["resident_bytes"] > 0 and out["kv"]["total_bytes"] > 0


@pytest.mark.model
def test_generate_chat_applies_the_template(smollm2_dir, tmp_path):
    proc = icekv("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"  # the end-of-turn token ends it
    no_template = tmp_path / "model"
    no_template.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name != "chat_template.jinja":
            (no_template / f.name).symlink_to(f)
    proc = icekv("generate", "--chat", "--prompt", "hi", "--model", str(no_template))
    assert proc.returncode == 2 and "has no chat template" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", "hi", "--model", "/nonexistent/model"], "does not exist"),
        (["generate", "--prompt", "   "], "prompt is empty"),
        (["generate", "--prompt", "hi", "--max-tokens", "-3"], "--max-tokens must be >= 1"),
        (["generate", "--prompt-file", "/nonexistent.txt"], "--prompt-file"),
        (["generate"], "--prompt"),
        (["generate", "--prompt", "hi", "--policy", "magic"], "unknown policy"),
        (["generate", "--prompt", "hi", "--policy", "icecache", "--budget", "32"], "must exceed sink + window"),
        (["generate", "--prompt", "hi", "--policy", "quest", "--budget", "250"], "not a multiple of the page size"),
        (["serve", "--index-threads", "-1"], "--index-threads must be >= 0"),
        (["serve", "--replicas", "2"], "--replicas above 1 needs --router"),
        (["serve", "--replicas", "0", "--router", "cache_aware"], "--replicas must be >= 1"),
        (["serve", "--router", "nearest"], "invalid choice: 'nearest'"),
        (["serve", "--router", "cache_aware", "--grpc-port", "9001"], "--grpc-port is not used with --router"),
        (["serve", "--router", "round_robin", "--openai-port", "9000"], "--openai-port is not used with --router"),
        (["serve", "--router", "cache_aware", "--kv-events-endpoint", "tcp://*:5557"],
         "--kv-events-endpoint is not used with --router"),
        (["serve", "--idle-timeout-s", "soon"], "--idle-timeout-s must be a number, got 'soon'"),
        (["serve", "--request-timeout-s", "0"], "--request-timeout-s must be a positive number of seconds, got 0.0"),
        (["serve", "--request-timeout-s", "nan"], "--request-timeout-s must be a positive number of seconds, got nan"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    proc = icekv(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.model
def test_prompt_longer_than_the_cache_is_refused(smollm2_dir, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 400)
    proc = icekv("generate", "--prompt-file", str(prompt), "--pool-tokens", "256")
    assert proc.returncode == 2
    assert "exceeds the KV cache capacity of 256 tokens" in proc.stderr
