"""`icekv compress`, `generate --context-key`, `size`, `bench decode` and `bench batch`, run as a user would."""

import json

import pytest

from icekv.config.selection import SelectionConfig
from icekv.policies import resolve

from tests.test_cli import icekv, refused


@pytest.mark.model
def test_compress_then_answer_from_the_store(tmp_path, smollm2_dir):
    ctx = tmp_path / "doc.txt"
    ctx.write_text("The secret code of the vault is 4417. " + "The market was busy and the weather mild. " * 25)
    store = tmp_path / "store"
    proc = icekv("compress", "--context-file", str(ctx), "--method", "snapkv", "--kv-budget", "0.5",
                 "--store", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert not out["store_hit"] and out["bytes_after"] < 0.6 * out["bytes_before"]
    assert len(out["kept_tokens_per_layer_head"]) == 30
    again = json.loads(icekv("compress", "--context-file", str(ctx), "--method", "snapkv", "--kv-budget", "0.5",
                             "--store", str(store), "--json").stdout)
    assert again["store_hit"] and again["key"] == out["key"]
    gen = icekv("generate", "--context-key", out["key"], "--store", str(store), "--prompt",
                " Question: what is the secret code of the vault? Answer: The code is", "--max-tokens", "5", "--json")
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["kv"]["total_bytes"] > 0


@pytest.mark.parametrize("args, message", [
    (["compress", "--context-file", "/nonexistent.txt"], "--context-file"),
    (["compress", "--context-file", "README.md", "--kv-budget", "2"], "--kv-budget must be in (0, 1]"),
    (["compress", "--context-file", "README.md", "--method", "zip"], "unknown compression method"),
    (["compress", "--context-file", "README.md", "--method", "snapkv", "--kv2", "rho=0.5"],
     "--kv2 applies to --method kv2 only"),
    (["compress", "--context-file", "README.md", "--kv2", "rho=2"], "rho must be in (0, 1]"),
    (["compress", "--context-file", "README.md", "--kv2", "speed=9"], "kv2 has no setting 'speed'"),
    (["eval", "--compress", "kvzip", "--kv2", "rounds=2", "--out", "/tmp/x"], "--kv2 applies with --compress kv2"),
    (["eval", "--compress", "kv2", "--task", "passkey", "--out", "/tmp/x"], "cannot be asked as a reusable context"),
    (["generate", "--prompt", "x", "--context-key", "ab" * 32, "--store", "/tmp/icekv-empty-store"],
     "not in the context store"),
    (["generate", "--prompt", "x", "--context-key", "abc", "--store", "/tmp/icekv-empty-store"], "invalid context_key"),
    (["compress", "--context-file", "README.md", "--server", "localhost:1"], "cannot reach an icekv server"),
    (["compress", "--context-file", "README.md", "--server", "localhost:1", "--store", "x"],
     "--store does not apply with --server"),
    (["bench", "decode", "--policies", "magic"], "unknown policy"),
    (["bench", "batch", "--batch", "0,2"], "--batch values must be >= 1"),
    (["bench", "decode", "--contexts", "0"], "--contexts values must be >= 2 tokens"),
    (["bench", "batch", "--contexts", "4096,1"], "--contexts values must be >= 2 tokens"),
    (["bench", "batch", "--batch", "two"], "--batch: cannot read"),
    (["bench", "batch", "--policies", "full,nope"], "unknown policy"),
    (["eval", "--compress", "zip", "--out", "/tmp/x"], "--compress: unknown method"),
    (["eval", "--compress", "kv2", "--kv-budgets", "1.5", "--out", "/tmp/x"], "--kv-budgets"),
])
def test_bad_flags_are_clear_errors(capsys, args, message):
    err = refused(capsys, *args)
    assert message in err


@pytest.mark.model
def test_size_matches_the_model_shape(smollm2_dir):
    out = json.loads(icekv("size", "--context", "4096", "--concurrent", "2", "--budget", "256", "--json").stdout)
    assert out["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert out["host_pool_bytes"] == 2 * 4096 * out["kv_bytes_per_token"]
    assert out["device_bytes_budget"] < out["device_bytes_full"]
    assert 0 < out["index_host_bytes"] < out["host_pool_bytes"]  # per request: about 1.6x its indexed keys
    small = json.loads(icekv("size", "--context", "4096", "--score-dtype", "int8", "--json").stdout)
    assert 0.3 * out["index_host_bytes"] < small["index_host_bytes"] < 0.5 * out["index_host_bytes"]  # keys 68 B, not 256
    assert out["index_share"] == pytest.approx(2 * out["index_host_bytes"] / out["host_pool_bytes"])
    bf16 = json.loads(icekv("size", "--context", "4096", "--dtype", "bfloat16", "--json").stdout)
    assert bf16["index_share"] < 1  # bf16 page keys under a bf16 cache: the index is lighter than the KV
    bad = icekv("size", "--score-dtype", "float16")
    assert bad.returncode != 0 and "--score-dtype" in bad.stderr


@pytest.mark.model
def test_bench_decode_times_stages_and_first_token(capsys, smollm2_dir):
    proc = icekv("bench", "decode", "--contexts", "600", "--policies", "full,icecache", "--budget", "64",
                   "--steps", "3", "--repeats", "2", "--ttft-contexts", "600", "--model", str(smollm2_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    plan, full, ice, meta = map(json.loads, proc.stdout.splitlines())  # one JSON line each, as measured
    assert plan["plan"]["admitted"] and "meta" in meta
    assert full["policy"] == "full" and ice["policy"] == "icecache"
    assert full["prefill_s"] > 0 and full["ttft_s"] == full["prefill_s"]  # no index for full attention
    assert ice["ttft_s"] == ice["prefill_s"] + ice["index_build_s"] and ice["index_build_s"] > 0
    assert ice["select_s"] > 0 and ice["resident_kv_bytes"] < ice["total_kv_bytes"]
    assert full["index_bytes"] == 0 and 0 < ice["index_bytes"] < ice["total_kv_bytes"]
    assert full["repeats"] == ice["repeats"] == 2  # times are medians of two interleaved decodes
    for r in (full, ice):  # the slowest is among the timed steps; the first is the warm-up's
        assert 0 < r["step_max_s"] <= r["tpot_s"] * r["steps"] and r["steps"] == 3 and r["warmup_steps"] == 2
        assert 0 < r["first_step_s"] and 0 < r["tpot_median_s"] <= r["step_max_s"]
    assert "--ttft-contexts" in refused(capsys, "bench", "decode", "--contexts", "600", "--ttft-contexts", "700",
                                        "--model", str(smollm2_dir))


@pytest.mark.model
def test_bench_batch_reports_throughput_and_the_step_split(smollm2_dir, tmp_path):
    proc = icekv("bench", "batch", "--contexts", "400", "--batch", "1,3", "--policies", "full,icecache", "--budget", "64",
                 "--steps", "4", "--model", str(smollm2_dir), "--out", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    records = [x for x in map(json.loads, proc.stdout.splitlines()) if "policy" in x]
    assert [(r["batch"], r["policy"]) for r in records] == [(1, "full"), (1, "icecache"), (3, "full"), (3, "icecache")]
    for r in records:
        assert r["steps"] == 4 and r["tokens_per_s"] > 0
        assert 0 < r["step_median_s"] <= r["step_p99_s"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["steps"] / (r["steps"] * r["mean_step_s"]))
    ice = [r for r in records if r["policy"] == "icecache"]
    assert all(r["select_s"] > 0 and r["index_bytes"] > 0 for r in ice)
    assert ice[1]["index_bytes"] == 3 * ice[0]["index_bytes"]  # three requests, three indexes of one context
    assert (tmp_path / "report.md").read_text().count("| 400 |") == 4 and (tmp_path / "throughput.png").stat().st_size


@pytest.mark.model
def test_bench_batch_repeats_interleave_and_report_medians(smollm2_dir, tmp_path):
    proc = icekv("bench", "batch", "--contexts", "300", "--batch", "1,2", "--policies", "icecache", "--budget", "64",
                 "--steps", "2", "--repeats", "3", "--model", str(smollm2_dir), "--out", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stderr.splitlines() if " x" in line and "tokens/s" in line]
    assert [line.split(":")[0].split()[-2] for line in progress] == ["x1", "x2", "x2", "x1", "x1", "x2"]  # passes alternate
    records = [x for x in map(json.loads, proc.stdout.splitlines()) if "policy" in x]
    assert [r["batch"] for r in records] == [1, 2] and all(r["repeats"] == 3 for r in records)
    assert all(len(r["tokens_per_s_runs"]) == 3 and min(r["tokens_per_s_runs"]) <= r["tokens_per_s"]
               <= max(r["tokens_per_s_runs"]) for r in records)
    assert "median of 3 interleaved runs" in (tmp_path / "report.md").read_text()


def test_gpu_benches_time_each_policy_with_its_serving_pool_placement():
    from icekv.cli.bench import _pool_groups

    policies = ("full", "icecache", "icecache_r")
    plans = {p: resolve(SelectionConfig(policy=p)) for p in policies}
    assert _pool_groups(plans, {"device": "cuda"}, "cuda") == [
        ({"device": "cuda", "kv_pool": "device"}, ("full",)),
        ({"device": "cuda", "kv_pool": "host"}, ("icecache", "icecache_r"))]
    assert _pool_groups(plans, {"kv_pool": "host"}, "cuda") == [({"kv_pool": "host"}, policies)]  # as asked
    assert _pool_groups(plans, {}, "cpu") == [({}, policies)]  # one place on a CPU: one engine
