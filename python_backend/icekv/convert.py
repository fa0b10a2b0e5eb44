"""Convert a GGUF checkpoint into a safetensors model folder: ``python -m icekv.convert GGUF OUT``.

Runs in its own process (the asset fetcher starts it) so transformers' memory and import cost
never stay in the serving process. transformers dequantizes the GGUF weights to fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m icekv.convert GGUF_FILE OUT_DIR", file=sys.stderr)
        return 2
    convert_gguf(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
