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
