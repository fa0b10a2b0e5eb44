"""bench/long_output_tpot.py pairs the steps of a decode late in its output with one early in it."""

import importlib.util
from pathlib import Path

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.engine import Engine
from icekv.eval.decode_bench import DecodeBenchConfig, plans_for

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("long_output_tpot", BENCH / "long_output_tpot.py")
long_output_tpot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(long_output_tpot)


def test_each_side_steps_once_a_pair_from_its_own_position_and_is_freed(smollm2_dir, essays_text):
    engines = {name: Engine(EngineConfig(model_dir=str(smollm2_dir), paging=PagingConfig(pool_tokens=1024)))
               for name in ("early", "late")}
    plan = plans_for(DecodeBenchConfig(contexts=(300,), policies=("icecache",), budget=64))["icecache"]
    free = {name: e.cache.pages_available for name, e in engines.items()}
    sides = long_output_tpot.measure(engines, {"early": 3, "late": 70}, plan, 300, 6, essays_text, 100)
    assert {name: side["position"] for name, side in sides.items()} == {"early": 3, "late": 70}
    for side in sides.values():
        assert len(side["step_s"]) == 6 and min(side["step_s"]) > 0
        assert side["tpot_s"] == sum(side["step_s"]) / 6
        assert side["select_s"] > 0 and side["attention_s"] > 0  # the policy's stages ran in the paired steps
    assert {name: e.cache.pages_available for name, e in engines.items()} == free  # every request released
    result = {"command": "cmd", "model": "m", "context": 300, "policy": "icecache", "budget": 64, "pairs": 6,
              "machine": "x", "commit": "c", "date": "d", "sides": sides}
    text = long_output_tpot.report(result)
    assert "| early (3) |" in text and "| late (70) |" in text
    ratio = sides["late"]["tpot_s"] / sides["early"]["tpot_s"]
    assert f"the means: {ratio:.3f}x" in text
