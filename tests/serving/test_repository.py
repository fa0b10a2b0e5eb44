"""The committed model repository is exactly what the launcher would generate."""

from pathlib import Path

from icekv.serving.repository import SHIM, render_config

ROOT = Path(__file__).resolve().parents[2] / "model_repository" / "icekv"


def test_committed_repository_matches_the_generator():
    assert (ROOT / "config.pbtxt").read_text() == render_config()
    assert (ROOT / "1" / "model.py").read_text() == SHIM.read_text()


def test_config_is_decoupled_python_with_parameters():
    text = render_config({"policy": "quest"})
    assert 'backend: "python"' in text and "decoupled: true" in text
    assert 'key: "policy" value: { string_value: "quest" }' in text
