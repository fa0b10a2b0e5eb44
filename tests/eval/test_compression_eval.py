"""`icekv eval --compress` end to end: every task, variant and budget reported with an interval,
timed beyond one shared prefill."""

import json

import pytest

from icekv.eval.stats import wilson_interval
from tests.test_cli import icekv, refused


@pytest.mark.parametrize("right, n, low, high", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634),
                                                  (40, 40, 0.9124, 1.0), (1, 1, 0.2065, 1.0)])
def test_wilson_interval_matches_known_values(right, n, low, high):
    got = wilson_interval(right, n)
    assert got == pytest.approx((low, high), abs=1e-4)


@pytest.mark.model
def test_compression_eval_reports_every_cell(tmp_path, smollm2_dir):
    out = tmp_path / "run"
    proc = icekv("eval", "--compress", "kv2,snapkv", "--kv2", "rho_scale=4,normalize=true",
                 "--task", "niah_single,niah_multikey", "--kv-budgets", "0.05,0.25", "--lengths", "600",
                 "--samples", "1", "--questions", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = json.loads((out / "results.json").read_text())["records"]
    cells = {(r["task"], r["method"], r["kv_budget"]) for r in records}
    assert cells == {(t, m, b) for t in ("niah_single", "niah_multikey") for m, b in
                     [("full", 1.0), ("kv2", 0.05), ("kv2", 0.25), ("snapkv", 0.05), ("snapkv", 0.25)]}
    for r in records:
        assert r["n"] == (1 if r["task"] == "niah_single" else 3)
        low, high = r["ci95"]
        assert low <= r["accuracy"] <= high
        assert r["compress_s"] > 0 and r["prefill_s"] > 0
        if r["method"] == "kv2":
            assert r["settings"] == {"rho_scale": 4.0, "normalize": True}
        if r["method"] != "full":
            assert r["kv_bytes"] < 0.4 * r["full_kv_bytes"]
    by_task = {}
    for r in records:  # one prefill per context, shared by every row
        by_task.setdefault(r["task"], set()).add(r["prefill_s"])
    assert all(len(p) == 1 for p in by_task.values())
    assert "95% interval" in (out / "report.md").read_text()


@pytest.mark.model
def test_a_long_compression_run_logs_each_context_and_resumes(capsys, tmp_path, smollm2_dir):
    """Each context is one log line written as it finishes (its answers and each cell's cost);
    --resume keeps it and runs only the contexts the grown grid adds, a line cut by an
    interruption runs again, and a different grid is refused."""
    out = tmp_path / "run"
    grid = ["--compress", "snapkv", "--task", "niah_multikey", "--kv-budgets", "0.25", "--lengths", "600",
            "--questions", "2", "--out", str(out)]
    proc = icekv("eval", *grid, "--samples", "1")
    assert proc.returncode == 0, proc.stderr
    log = out / "runs.jsonl"
    first = log.read_text().splitlines()
    assert len(first) == 2 and "config" in json.loads(first[0])
    entry = json.loads(first[1])
    assert entry["context"] == "niah_multikey/600/0" and len(entry["expected"]) == 2
    assert {(c["method"], c["kv_budget"]) for c in entry["cells"]} == {("full", 1.0), ("snapkv", 0.25)}
    assert all(len(c["answers"]) == len(c["right"]) == 2 for c in entry["cells"])

    log.write_text("\n".join(first) + "\n" + first[1][:50])  # an interrupted write of a second context
    proc = icekv("eval", *grid, "--samples", "3", "--resume")
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[:2] == first  # kept as it was, not run again
    assert [json.loads(line)["context"] for line in lines[2:]] == ["niah_multikey/600/1", "niah_multikey/600/2"]
    records = json.loads((out / "results.json").read_text())["records"]
    assert {(r["n"], r["contexts"]) for r in records} == {(6, 3)}
    full = next(r for r in records if r["method"] == "full")
    assert full["accuracy"] == sum(s for line in lines[1:] for s in json.loads(line)["cells"][0]["right"]) / 6

    assert "different evaluation grid" in refused(capsys, "eval", *grid[:-2], "--kv-budgets", "0.1", "--out", str(out),
                                                  "--resume")
