"""bench/kv_dtype_tpot.py times every (format, policy) each repeat, over one engine per format."""

import importlib.util
from pathlib import Path

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.eval.decode_bench import DecodeBenchConfig

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("kv_dtype_tpot", BENCH / "kv_dtype_tpot.py")
kv_dtype_tpot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv_dtype_tpot)


def test_every_format_and_policy_timed_each_repeat_and_freed(smollm2_dir, essays_text):
    engines = {k: Engine(EngineConfig(model_dir=str(smollm2_dir), paging=PagingConfig(pool_tokens=1024, kv_dtype=k)))
               for k in ("auto", "int8")}
    cfg = DecodeBenchConfig(contexts=(300,), policies=("full", "icecache"), budget=64, steps=2, seed_tokens=100,
                            icecache=IceCacheConfig(search="centroids"), repeats=2, warmup_steps=1)
    free = {k: e.cache.pages_available for k, e in engines.items()}
    tpot = kv_dtype_tpot.time_formats(engines, cfg, essays_text, 300)
    assert set(tpot) == {(k, p) for k in engines for p in cfg.policies}
    assert all(len(t) == 2 and min(t) > 0 for t in tpot.values())
    assert {k: e.cache.pages_available for k, e in engines.items()} == free  # every request released
    text = kv_dtype_tpot.report(tpot, 300, "cmd")
    assert "| full | auto |" in text and "| icecache | int8 |" in text and "1.00x [1.00-1.00]" in text
