"""bench/long_output_tpot.py pairs the steps of a decode late in its output with one early in it."""

import importlib.util
import statistics
from pathlib import Path

import pytest

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.engine import Engine
from icekv.eval.decode_bench import DecodeBenchConfig, plans_for

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("long_output_tpot", BENCH / "long_output_tpot.py")
long_output_tpot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(long_output_tpot)


def test_the_sides_alternate_from_their_own_positions_and_are_freed(smollm2_dir, essays_text, monkeypatch):
    engines = {name: Engine(EngineConfig(model_dir=str(smollm2_dir), paging=PagingConfig(pool_tokens=1024)))
               for name in ("early", "late")}
    plan = plans_for(DecodeBenchConfig(contexts=(300,), policies=("icecache",), budget=64))["icecache"]
    free = {name: e.cache.pages_available for name, e in engines.items()}
    calls = []
    for name, engine in engines.items():
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda step=step, name=name: (calls.append(name), step())[1])
    sides = long_output_tpot.measure(engines, {"early": 3, "late": 70}, plan, 300, 6, essays_text, 100)

    assert {name: side["tokens"] for name, side in sides.items()} == {"early": [4, 9], "late": [71, 76]}
    # the paired steps, every other pair reversed, then each side's last step (its cancel)
    assert calls[-14:] == ["early", "late", "late", "early"] * 3 + ["early", "late"]
    for side in sides.values():
        assert len(side["step_s"]) == 6 and min(side["step_s"]) > 0
        assert side["tpot_s"] == pytest.approx(statistics.mean(side["step_s"]))
        stages = side["select_s"] + side["transfer_s"] + side["attention_s"] + side["insert_s"]
        assert 0 < side["select_s"] and stages <= side["tpot_s"]  # the paired steps' own stage times, inside them
    assert all(not e.scheduler.running for e in engines.values())  # both decodes ended
    assert {name: e.cache.pages_available for name, e in engines.items()} == free  # every request released

    result = {"command": "cmd", "model": "m", "context": 300, "policy": "icecache", "budget": 64, "pairs": 6,
              "machine": "x", "commit": "c", "date": "d", "sides": sides}
    text = long_output_tpot.report(result)
    assert "| early: tokens 4-9 |" in text and "| late: tokens 71-76 |" in text
    ratios = [b / a for a, b in zip(sides["early"]["step_s"], sides["late"]["step_s"])]
    assert f"median {statistics.median(ratios):.3f}x" in text
