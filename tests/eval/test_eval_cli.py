"""`icekv eval` end to end on a small grid, and its refusals."""

import json

import pytest

from tests.test_cli import icekv


@pytest.mark.model
def test_small_eval_writes_results_report_and_plot(tmp_path, smollm2_dir):
    out = tmp_path / "run"
    proc = icekv("eval", "--task", "niah_single", "--lengths", "600", "--policies", "full,streaming,icecache",
                 "--budgets", "64,128", "--samples", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = json.loads((out / "results.json").read_text())["records"]
    keys = {(r["policy"], r["budget"]) for r in records}
    assert keys == {("full", None), ("streaming", 64), ("streaming", 128), ("icecache", 64), ("icecache", 128)}
    for r in records:
        assert r["n"] == 2 and 0 <= r["accuracy"] <= 1 and r["task"] == "niah_single" and r["length"] == 600
        if r["policy"] != "full":
            assert 0 < r["recall"] <= 1 and len(r["layers"]) == 28
            assert r["resident_bytes"] < r["total_bytes"]
    assert "| icecache | 128 |" in (out / "report.md").read_text()
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert "eval" in proc.stderr  # progress bar on stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "full,magic"], "unknown policy"),
        (["--budgets", "32"], "must exceed sink"),
        (["--budgets", "100"], "not a multiple of the page size"),
        (["--task", "summarize"], "--task: unknown task"),
        (["--lengths", "2k"], "--lengths"),
        (["--depths", "1.5"], "--depths"),
    ],
)
def test_bad_eval_flags(tmp_path, args, message):
    proc = icekv("eval", "--out", str(tmp_path), "--policies", "full,icecache", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
