"""The installed ``icekv`` console script, run as a user would."""

import json
import os
import signal
import subprocess
import sys

import pytest


def icekv(*args, timeout=600):
    exe = os.path.join(os.path.dirname(sys.executable), "icekv")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def refused(capsys, *args, timeout_s: int = 60) -> str:
    """What ``icekv args`` prints on stderr as it refuses them with status 2, run in this process:
    a refusal needs no interpreter of its own (each takes seconds to start), and the console
    script itself runs in the tests that go through a command. An error the CLI does not turn
    into a clear one is raised here, failing the test; a command that does not end within
    ``timeout_s`` (a serve that started) fails it too."""
    from icekv.cli import main

    def late(*_):
        raise TimeoutError(f"icekv {' '.join(args)} did not refuse within {timeout_s} s")

    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}  # serve sets its own
    signal.signal(signal.SIGALRM, late)
    signal.alarm(timeout_s)
    try:
        status = main(list(args))
    except SystemExit as e:  # argparse's refusals
        status = e.code
    finally:
        signal.alarm(0)
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    assert status == 2, capsys.readouterr()
    return capsys.readouterr().err


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
def test_generate_chat_applies_the_template(capsys, smollm2_dir, tmp_path):
    proc = icekv("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"  # the end-of-turn token ends it
    no_template = tmp_path / "model"
    no_template.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name != "chat_template.jinja":
            (no_template / f.name).symlink_to(f)
    err = refused(capsys, "generate", "--chat", "--prompt", "hi", "--model", str(no_template))
    assert "has no chat template" in err


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
def test_bad_input_is_a_clear_error(capsys, args, message):
    err = refused(capsys, *args)
    assert message in err


@pytest.mark.model
def test_prompt_longer_than_the_cache_is_refused(capsys, smollm2_dir, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 400)
    err = refused(capsys, "generate", "--prompt-file", str(prompt), "--pool-tokens", "256")
    assert "exceeds the KV cache capacity of 256 tokens" in err
