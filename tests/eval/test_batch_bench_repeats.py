"""Repeated batch timings collapse to medians, and the scaling vs batch 1 pairs the runs of a pass."""

import pytest

from icekv.eval.batch_bench import SPLIT, median_run
from icekv.eval.batch_report import vs_batch_1

TIMES = ("tokens_per_s", "step_median_s", "step_p99_s", "mean_step_s", "first_step_s", "dense_other_s", *SPLIT)


def test_median_run_takes_every_time_median_and_keeps_each_rate():
    runs = [dict({k: float(i) for k in TIMES}, steps=4, index_bytes=7) for i in (3, 1, 2)]
    out = median_run(runs)
    assert out["repeats"] == 3 and out["steps"] == 4 and out["index_bytes"] == 7
    assert all(out[k] == 2.0 for k in TIMES)
    assert out["tokens_per_s_runs"] == [3.0, 1.0, 2.0]


def test_scaling_is_the_median_of_paired_ratios():
    # the machine slowed down in the second pass, both batches alike: the pairs say 3, 3 and 2,
    # while the medians' ratio (16 / 8) would say 2
    single = median_run([{k: v for k in TIMES} for v in (10.0, 4.0, 8.0)])
    batch = median_run([{k: v for k in TIMES} for v in (30.0, 12.0, 16.0)])
    assert vs_batch_1(batch, single) == pytest.approx(3.0)
    # unpaired (one run each, or records without runs): the ratio of the rates
    assert vs_batch_1({"tokens_per_s": 24.0}, {"tokens_per_s": 8.0}) == pytest.approx(3.0)
