"""bench/kv_decode_kernel.py times every KV format's decode, interleaved, over a partial last page."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("kv_decode_kernel", BENCH / "kv_decode_kernel.py")
kv_decode_kernel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv_decode_kernel)


def test_every_format_is_timed_each_repeat_and_reported():
    seconds = kv_decode_kernel.time_formats(tokens=37, repeats=3)
    assert set(seconds) == set(kv_decode_kernel.FORMATS)
    assert all(len(times) == 3 and min(times) > 0 for times in seconds.values())
    text = kv_decode_kernel.report(seconds, 37, "cmd")
    assert all(f"| {name} |" in text for name in kv_decode_kernel.FORMATS) and "| auto | " in text and "1.00x" in text
