"""Where a model's files are, and the id of what they hold."""

from __future__ import annotations

import hashlib
from pathlib import Path

from icekv.registry import DEFAULT_MODEL, KNOWN_MODELS, is_gguf, not_a_model


def model_identity(model_dir: Path, dtype: str) -> str:
    """A stable id for stored artefacts: the config's hash, the weights' sizes and the dtype."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return f"{digest.hexdigest()[:24]}:{dtype}"


def resolve_model_dir(model: str | None) -> Path:
    """A model folder, a known model's name (:mod:`icekv.registry`: fetched and converted on
    first use) or a GGUF file (converted on first use); None is the default model."""
    from icekv.assets import Assets

    if model is None or model in KNOWN_MODELS:
        return Assets().model_dir(model or DEFAULT_MODEL)
    path = Path(model)
    if is_gguf(model):
        return Assets().gguf_model_dir(path)
    if not path.is_dir():
        raise not_a_model(model)
    return path
