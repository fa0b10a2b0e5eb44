"""The evaluation log's grid check: a resumed run must be the grid that wrote the log."""

import json

import pytest

from icekv.errors import ConfigError
from icekv.eval.run_log import RunLog, grid_of
from icekv.eval.runner import EvalConfig

GROWABLE = ("tasks", "lengths", "samples")


def _log_without(tmp_path, field: str, cfg: EvalConfig):
    """A log whose grid was written before ``field`` existed, one context finished."""
    grid = grid_of(cfg, GROWABLE)
    del grid[field]
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps({"config": grid}) + "\n" + json.dumps({"context": "niah_multikey/600/0", "runs": []}) + "\n")
    return path


def _resume(path, cfg: EvalConfig) -> dict:
    return RunLog(path, grid_of(cfg, GROWABLE), defaults=grid_of(EvalConfig(), GROWABLE)).start(resume=True)


def test_a_log_older_than_a_field_resumes_at_its_default(tmp_path):
    cfg = EvalConfig(tasks=("niah_multikey",), questions=2, num_needles=4)
    path = _log_without(tmp_path, "distinct_key_words", cfg)
    assert list(_resume(path, cfg)) == ["niah_multikey/600/0"]
    assert json.loads(path.read_text().splitlines()[0])["config"]["distinct_key_words"] is False  # rewritten whole


def test_a_log_older_than_a_field_is_refused_away_from_its_default(tmp_path):
    cfg = EvalConfig(tasks=("niah_multikey",), questions=2, num_needles=4)
    path = _log_without(tmp_path, "distinct_key_words", cfg)
    with pytest.raises(ConfigError, match="different evaluation grid"):
        _resume(path, EvalConfig(tasks=("niah_multikey",), questions=2, num_needles=4, distinct_key_words=True))


def test_a_field_the_grid_no_longer_has_is_refused(tmp_path):
    cfg = EvalConfig(tasks=("niah_multikey",), questions=2, num_needles=4)
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps({"config": {**grid_of(cfg, GROWABLE), "retired": 1}}) + "\n")
    with pytest.raises(ConfigError, match="different evaluation grid"):
        _resume(path, cfg)
