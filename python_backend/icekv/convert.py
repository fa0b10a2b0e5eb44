"""Convert a GGUF checkpoint into a safetensors model folder: ``python -m icekv.convert GGUF OUT``.

Runs in its own process (the asset fetcher starts it) so transformers' memory and import cost
never stay in the serving process. transformers dequantizes the GGUF weights to fp32; the 4-bit
linear weights are also kept as they are, for ``--weights int4``
(:mod:`icekv.model.gguf_blocks`). Where transformers' reader leaves a setting that llama.cpp's
loader reads or derives at its default (Gemma 3's), the folder's config gets llama.cpp's value.
:func:`check_gguf` reads only the file's header, in the caller's process, so that a file icekv
cannot run is refused by name before any conversion starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from icekv.errors import ModelLoadError

# GGUF architectures (``general.architecture``) whose conversion is a model icekv runs
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
GEMMA3_27B_LAYERS = 62  # llama.cpp tells Gemma 3's sizes apart by depth: its 27B scales queries by hidden / heads


def check_gguf(gguf: Path) -> str:
    """The architecture of the GGUF file ``gguf``, once it is one icekv runs and every tensor is of
    a type the conversion dequantizes; ModelLoadError naming what is not."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise ModelLoadError("reading a GGUF file needs the gguf package: pip install 'icekv[convert]'") from None

    try:
        reader = GGUFReader(gguf)
    except (ValueError, OSError) as e:  # a wrong magic, a truncated header or table
        raise ModelLoadError(f"{gguf} is not a readable GGUF file ({e})") from None
    architecture = _field(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf}: GGUF architecture {architecture!r} is not one icekv runs "
                             f"({', '.join(GGUF_ARCHITECTURES)})")
    if architecture == "gemma3":
        scaling = _field(reader, "gemma3.rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise ModelLoadError(f"{gguf}: a Gemma 3 GGUF with RoPE scaling {scaling!r} (icekv reads linear scaling)")
        if scaling == "linear" and _field(reader, "gemma3.rope.scaling.factor") is None:
            raise ModelLoadError(f"{gguf}: a Gemma 3 GGUF with linear RoPE scaling and no gemma3.rope.scaling.factor")
    unreadable = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind.name in unreadable:
            continue
        try:
            dequantize(tensor.data[:1], kind)  # one row: what the conversion does to every row
        except (NotImplementedError, ValueError, KeyError):
            unreadable[kind.name] = tensor.name
    if unreadable:
        listed = ", ".join(f"{kind} (first: {name})" for kind, name in unreadable.items())
        raise ModelLoadError(f"{gguf}: tensor type(s) the conversion cannot dequantize: {listed}")
    return architecture


def _field(reader, key: str):
    """The value of GGUF metadata ``key``; None where the file has none."""
    field = reader.get_field(key)
    return field.contents() if field is not None else None


def gemma3_config(config: dict, reader) -> dict:
    """A converted Gemma 3 GGUF's ``config`` as llama.cpp runs the file: transformers' reader keeps
    neither the global layers' linear RoPE scaling (``gemma3.rope.scaling.*``) nor the query scale,
    which the file does not hold (llama.cpp: the head size, or hidden size / heads on the 27B).
    The local layers' RoPE base (10,000) and pattern (every sixth layer global) are llama.cpp's
    fixed values and transformers' defaults alike."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    scalar = config["hidden_size"] // heads if layers == GEMMA3_27B_LAYERS else config["head_dim"]
    rope = {kind: dict(params) for kind, params in config["rope_parameters"].items()}
    if _field(reader, "gemma3.rope.scaling.type") == "linear":  # the one kind check_gguf lets through
        rope["full_attention"].update(rope_type="linear", factor=float(_field(reader, "gemma3.rope.scaling.factor")))
    return {**config, "query_pre_attn_scalar": scalar, "rope_parameters": rope}


def convert_gguf(gguf: Path, out: Path) -> None:
    import json

    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are dequantized now: saving must not claim a GGUF quantization
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    reader = GGUFReader(gguf)
    architecture = _field(reader, "general.architecture")
    if architecture == "gemma3":
        config_path = out / "config.json"
        config_path.write_text(json.dumps(gemma3_config(json.loads(config_path.read_text()), reader), indent=2))
    _save_int4_blocks(gguf, architecture, model, out)


def _save_int4_blocks(gguf: Path, architecture: str, model, out: Path) -> None:
    from safetensors.torch import save_file

    from icekv.model.gguf_blocks import BLOCKS_FILE, gguf_int4_blocks

    config = model.config
    try:
        blocks = gguf_int4_blocks(gguf, model.state_dict(), architecture, config.num_attention_heads,
                                  config.num_key_value_heads)
    except Exception as e:  # the weights above are the conversion; int4 then quantizes them at load
        print(f"icekv.convert: the 4-bit blocks of {gguf.name} are not kept: {e}", file=sys.stderr)
        return
    if blocks:
        (out / BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
        save_file(blocks, str(out / BLOCKS_FILE))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m icekv.convert GGUF_FILE OUT_DIR", file=sys.stderr)
        return 2
    convert_gguf(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
