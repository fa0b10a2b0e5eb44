"""Load a Hugging Face model folder (config.json + safetensors) into a :class:`Decoder`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from icekv.errors import ModelLoadError
from icekv.model.args import ModelArgs
from icekv.model.llama import Decoder, Rotary


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model directory {model_dir}")
    return files


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Decoder:
    """Build the decoder for ``model_dir`` with its weights, in ``dtype``, ready for inference."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    args = ModelArgs.from_dir(model_dir)
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        for name, tensor in load_file(str(path)).items():
            state[name.removeprefix("model.")] = tensor.to(dtype)
    with torch.device("meta"):
        model = Decoder(args)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and args.tie_word_embeddings)]
    if missing:
        raise ModelLoadError(f"{model_dir}: weights missing for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(args)  # its buffer was created on the meta device
    return model.eval()
