"""Repeated decode timings collapse to per-field medians."""

from icekv.eval.decode_bench import TIMES, median_record


def test_median_record_takes_every_time_field_median_and_keeps_the_rest():
    runs = [dict({k: float(i) for k in TIMES}, policy="icecache", ttft_s=None, index_bytes=7) for i in (3, 1, 2)]
    out = median_record(runs)
    assert out["repeats"] == 3 and out["policy"] == "icecache" and out["index_bytes"] == 7
    assert all(out[k] == 2.0 for k in TIMES if k != "ttft_s") and out["ttft_s"] is None


def test_first_decode_on_the_prefill_built_index_keeps_its_time_to_first_token():
    runs = [dict({k: float(i) for k in TIMES}, index_prebuilt=i == 3) for i in (3, 1, 2)]
    out = median_record(runs)  # the first run waited on prefill's index; the others rebuilt theirs
    assert out["index_build_s"] == out["ttft_s"] == 3.0
    assert all(out[k] == 2.0 for k in TIMES if k not in ("index_build_s", "ttft_s"))


def test_a_long_output_is_reported_in_windows_that_add_up_to_its_timed_steps(engine, essays_text):
    import pytest

    from icekv.errors import ConfigError
    from icekv.eval.decode_bench import SPLIT, DecodeBenchConfig, plans_for, run_decode_bench

    for bad in ({"warmup_steps": 0}, {"repeats": 2}):
        with pytest.raises(ConfigError, match=r"warm-up step .* \(no repeats\)"):
            DecodeBenchConfig(window=4, **bad)
    cfg = DecodeBenchConfig(contexts=(600,), policies=("full", "icecache"), budget=64, steps=40, seed_tokens=300,
                            window=16)
    for r in run_decode_bench(engine, cfg, essays_text, plans_for(cfg)):
        windows = r["windows"]
        assert [(w["start"], w["steps"]) for w in windows] == [(0, 16), (16, 16), (32, 8)]
        assert abs(sum(w["tpot_s"] * w["steps"] for w in windows) / r["steps"] - r["tpot_s"]) < 1e-9
        for k in SPLIT:  # the stage times of the windows are the record's, split
            assert abs(sum(w[k] * w["steps"] for w in windows) / r["steps"] - r[k]) < 1e-9
        added = sum(w["kv_bytes_per_token"] * w["steps"] for w in windows)  # whole pages, as the output fills them
        assert abs(added - 40 * engine.cache.bytes_per_token) <= engine.cache.bytes_per_page
        if r["policy"] == "icecache":  # the index grows as pages leave the window, and only then
            assert windows[-1]["index_bytes"] >= windows[0]["index_bytes"] > 0
        else:
            assert all(w["index_bytes"] == 0 for w in windows)
