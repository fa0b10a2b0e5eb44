"""bench/candidates_cost.py: its variants are valid ``icekv bench decode`` flags that set the
candidate rule they are named after, and its summary takes each cell's median over the rounds."""

import importlib.util
from pathlib import Path

from icekv.cli import build_parser
from icekv.cli.common import _icecache_config

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("candidates_cost", BENCH / "candidates_cost.py")
candidates_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(candidates_cost)


def test_variants_set_the_candidate_rule_they_name():
    configs = {name: _icecache_config(build_parser().parse_args(["bench", "decode", *flags]))
               for name, flags in candidates_cost.VARIANTS.items()}
    assert configs["candidates96"].candidates(2) == 96 and configs["candidates256"].candidates(2) == 256
    assert configs["exhaustive"].search == "exhaustive"


def test_summary_is_each_cells_median_over_rounds():
    rec = lambda tpot, select: {"tpot_s": tpot, "select_s": select, "index_build_s": 1.0}  # noqa: E731
    times = {("exhaustive", 64, 16384): [rec(0.3, 0.05), rec(0.1, 0.01), rec(0.2, 0.03)],
             ("candidates96", 64, 16384): [rec(0.1, 0.01)]}
    text = candidates_cost.summary(times, "cmd")
    assert "| 64 | 16384 | exhaustive | 200.0 | 30.0 | 1.00 |" in text
    assert "| 64 | 16384 | candidates96 | 100.0 | 10.0 | 1.00 |" in text
