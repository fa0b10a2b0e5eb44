"""Load a Hugging Face model folder (config.json + safetensors) into a :class:`Decoder`.

The load is strict: a tensor the decoder lacks, or a weight the checkpoint lacks, is an error
naming it, so a wrong or partial checkpoint never runs. Two kinds of extra tensor are known to
be harmless and skipped: rotary frequency tables that older checkpoints saved (the decoder
computes its own) and an output matrix saved beside tied embeddings (the embedding is used).
``allow_extra_weights`` skips any other extra tensor as well, for a checkpoint that carries more than
the model needs.
"""

from __future__ import annotations

import json
import re
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


DERIVED = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # saved by older checkpoints
LISTED = 8  # names an error lists before it counts the rest


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, allow_extra_weights: bool = False
               ) -> Decoder:
    """Build the decoder for ``model_dir`` with its weights, in ``dtype``, ready for inference;
    ``allow_extra_weights``: skip tensors the decoder has no place for instead of refusing them."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    args = ModelArgs.from_dir(model_dir)
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        for name, tensor in load_file(str(path)).items():
            name = name.removeprefix("model.")
            if not DERIVED.fullmatch(name):
                state[name] = tensor.to(dtype)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the output matrix
    with torch.device("meta"):
        model = Decoder(args)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and args.tie_word_embeddings)]
    if missing:
        raise ModelLoadError(f"{model_dir}: the checkpoint lacks {len(missing)} weight(s) of "
                             f"{args.architecture}: {_names(missing)}")
    if result.unexpected_keys and not allow_extra_weights:
        raise ModelLoadError(f"{model_dir}: the checkpoint holds {len(result.unexpected_keys)} tensor(s) that "
                             f"{args.architecture} has no place for: {_names(result.unexpected_keys)} (a "
                             "different architecture or a damaged checkpoint; the setting allow_extra_weights "
                             "skips them)")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(args)  # its buffer was created on the meta device
    return model.eval()
