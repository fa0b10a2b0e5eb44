"""Convert a GGUF checkpoint into a safetensors model folder: ``python -m icekv.convert GGUF OUT``.

Runs in its own process (the asset fetcher starts it) so transformers' memory and import cost
never stay in the serving process. transformers dequantizes the GGUF weights to fp32; the 4-bit
linear weights are also kept as they are, for ``--weights int4``
(:mod:`icekv.model.gguf_blocks`).
:func:`check_gguf` reads only the file's header, in the caller's process, so that a file icekv
cannot run is refused by name before any conversion starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from icekv.errors import ModelLoadError

# GGUF architectures (``general.architecture``) whose conversion is a model icekv runs
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# architectures icekv runs from a folder but not from GGUF, and why
GGUF_REFUSED = {"gemma3": "transformers' GGUF reader drops Gemma 3's RoPE scaling and query scale (the 4B-27B "
                          "models would run wrong); load its Hugging Face folder instead"}


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
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture in GGUF_REFUSED:
        raise ModelLoadError(f"{gguf}: GGUF architecture {architecture!r}: {GGUF_REFUSED[architecture]}")
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf}: GGUF architecture {architecture!r} is not one icekv runs "
                             f"({', '.join(GGUF_ARCHITECTURES)})")
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


def convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are dequantized now: saving must not claim a GGUF quantization
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_int4_blocks(gguf, model, out)


def _save_int4_blocks(gguf: Path, model, out: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from icekv.model.gguf_blocks import BLOCKS_FILE, gguf_int4_blocks

    architecture = GGUFReader(gguf).get_field("general.architecture").contents()
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
