"""bench/needle_pages.py's bookkeeping: every needle of a rebuilt context is found at the token
positions that hold it, and the probe's masks are grouped into decode steps."""

import importlib.util
from pathlib import Path

import pytest
import torch

from icekv.eval.tasks import HaystackSampler, PromptFormat

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("needle_pages", BENCH / "needle_pages.py")
needle_pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(needle_pages)


@pytest.mark.model
def test_every_needle_is_found_where_its_tokens_are(engine, essays_text):
    tok = engine.tokenizer
    sample = HaystackSampler(essays_text, tok).make_context("niah_multikey", 1500, seed=5, questions=2, num_needles=4)
    context = PromptFormat().context(sample.context)
    ids = tok.encode(context)
    spans = needle_pages.needle_spans(context, tok.encode)
    assert len(spans) == 4 and {a for q in sample.questions for a in q.answers} <= set(spans)
    for value, (a, v, b) in spans.items():
        assert 0 <= a < v < b <= len(ids)
        assert tok.decode(ids[v:b]).strip() == f"{value}."
        assert tok.decode(ids[a:v]).strip().startswith("One of the special magic numbers for ")


def test_masks_group_into_steps_and_coverage_counts_layer_head_pairs():
    log = needle_pages.AttendedLog()
    mask = torch.zeros(2, 10, dtype=torch.bool)  # [Hq, T]
    mask[0, 3] = True  # one of two query heads attends token 3
    log.calls = [(2, mask), (3, mask), (2, mask), (3, ~mask)]  # two steps over layers 2 and 3
    steps = log.steps()
    assert [len(s) for s in steps] == [2, 2]
    assert needle_pages.coverage(steps[0], 3, 4) == 0.5
    assert needle_pages.coverage(steps[0], 4, 5) == 0.0
    assert needle_pages.coverage(steps[1], 4, 5) == 0.5  # layer 3 inverted: both heads attend token 4
    assert needle_pages.coverage(steps[1], 3, 4) == 0.5  # layer 2's head 0, layer 3's head 1
