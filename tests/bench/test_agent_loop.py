"""bench/agent_loop.py's scoring: a call turn's recorded number, and each reply against full
attention's on the same prompt (the loops themselves run against a real server in the bench)."""

import importlib.util
from pathlib import Path

import pytest

from icekv.model import Tokenizer

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("agent_loop", BENCH / "agent_loop.py")
agent_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent_loop)


def _turn(kind: str, content: str = "", arguments: str | None = None, tokens: int = 5) -> dict:
    call = {"name": "record_number", "arguments": arguments, "id": "call_0"} if arguments is not None else None
    return {"kind": kind, "key": "alpha", "content": content, "call": call, "prompt_tokens": 100,
            "cached_tokens": 80, "completion_tokens": tokens, "ttft_s": 0.5, "tpot_ms": 20.0}


def test_a_call_records_its_number_or_none():
    assert agent_loop.recorded(_turn("call", arguments='{"key": "alpha", "number": 42}')) == 42
    assert agent_loop.recorded(_turn("call", arguments='{"key": "alpha"}')) is None
    assert agent_loop.recorded(_turn("call", arguments='{"key": ')) is None
    assert agent_loop.recorded(_turn("answer", "no call")) is None


@pytest.mark.model
def test_replies_are_scored_against_full_attentions(smollm2_dir):
    tokenizer = Tokenizer(smollm2_dir)
    full = [_turn("call", arguments='{"key": "alpha", "number": 42}'),
            _turn("answer", "The essay argues that startups should grow fast.")]
    same = agent_loop.compare(full, full, {"alpha": "42"}, tokenizer)
    assert same[0]["same_call"] and same[0]["full_correct"] and same[0]["policy_correct"]
    assert same[1]["identical"] and same[1]["shared"] == len(tokenizer.encode(full[1]["content"]))
    other = [_turn("call", arguments='{"key": "alpha", "number": 41}'),
             _turn("answer", "The essay argues that founders should sleep.")]
    rows = agent_loop.compare(full, other, {"alpha": "42"}, tokenizer)
    assert not rows[0]["same_call"] and rows[0]["full_correct"] and not rows[0]["policy_correct"]
    assert not rows[1]["identical"] and 0 < rows[1]["shared"] < len(tokenizer.encode(full[1]["content"]))
    text = agent_loop.report({"turns": rows, "policy": "icecache", "document_tokens": 1000, "command": "cmd",
                              "machine": "m", "commit": "c", "date": "d", "answer_tokens": 400})
    assert "by icecache in 0/1" in text and "identical in 0/1" in text and "number right: full yes, icecache no" in text
