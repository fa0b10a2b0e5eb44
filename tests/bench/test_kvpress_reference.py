"""bench/kvpress_reference.py's budget: kvpress keeps int(n * (1 - ratio)) of n tokens, so the ratio
it is given must keep exactly the budget icekv's policy attends."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("kvpress_reference", BENCH / "kvpress_reference.py")
kvpress_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kvpress_reference)


@pytest.mark.parametrize("n", [65, 1000, 2998, 3001, 16383, 32768, 131071])
@pytest.mark.parametrize("budget", [1, 64, 128, 255, 256, 1024])
def test_the_ratio_keeps_exactly_the_budget(n, budget):
    if budget >= n:
        assert kvpress_reference.keep_ratio(budget, n) == 0.0  # nothing removed
        return
    ratio = kvpress_reference.keep_ratio(budget, n)
    assert 0.0 < ratio < 1.0 and int(n * (1 - ratio)) == budget


def test_an_answer_ends_before_its_first_stop_string():
    assert kvpress_reference.until_stop(" 42.\nmore\n", ("\n",)) == " 42."
    assert kvpress_reference.until_stop(" a; b. c", (".", ";")) == " a"
    assert kvpress_reference.until_stop(" 42", ("\n",)) == " 42"
    assert kvpress_reference.until_stop(" 42\n", ()) == " 42\n"


def test_the_comparison_pairs_each_question_with_icekv_s_run_of_the_same_plan(tmp_path):
    import json

    icekv = [{"runs": [{"task": "t", "length": 9, "sample": i, "policy": p, "budget": b, "score": s}
                       for p, b, s in (("full", None, 1.0), ("snapkv", 128, float(i == 0)))]} for i in range(3)]
    kvpress = [{"context": f"t/9/{i}", "budget": b, "score": s}
               for i in range(3) for b, s in ((None, 1.0), (128, float(i == 1)))]
    (tmp_path / "icekv.jsonl").write_text("\n".join(json.dumps(e) for e in icekv))
    (tmp_path / "kvpress.jsonl").write_text("\n".join(json.dumps(r) for r in kvpress))
    table = kvpress_reference.compare(tmp_path / "kvpress.jsonl", tmp_path / "icekv.jsonl", "snapkv")
    assert "| full | 3/3 | 3/3 | 3 | 0 | 0 |" in table and "| 128 | 1/3 | 1/3 | 0 | 1 | 1 |" in table
