"""How far each weight format moves a model's predictions from float32's: over the first --tokens
tokens of the essays, teacher-forced (every format reads the same text), the share of positions
whose most likely next token equals float32's, and the mean KL divergence from float32's
distribution. Full attention, no KV cache (the model's own forward over the whole text). A model
converted from a GGUF whose 4-bit blocks it keeps has int4 twice: quantized from the weights, and
the GGUF's own blocks (what the engine loads).

    .venv/bin/python bench/weights_agreement.py --model qwen2.5-coder-0.5b --out bench/results/weights_agreement
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from icekv.assets import Assets
from icekv.attention import causal_attention
from icekv.engine.model_dir import resolve_model_dir
from icekv.model import Tokenizer, load_model
from icekv.model.gguf_blocks import load_int4_blocks
from icekv.model.weights import store_weights

FORMATS = ("bfloat16", "int8", "int4")


class DenseAttention:
    """Causal attention over the whole text (within a local layer's window), no cache."""

    def __init__(self, args):
        self.args = args

    def attend(self, layer, q, k, v):
        return causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), torch.arange(q.shape[0]),
                                self.args.window(layer))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a known model or a folder (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    reference_model = load_model(model_dir)
    ids = torch.tensor(Tokenizer(model_dir).encode(Assets().haystack_text("essays")[: 10 * args.tokens])[: args.tokens])
    positions = torch.arange(len(ids))
    reference = reference_model(ids, positions, DenseAttention(reference_model.args))  # [T, V]
    rows = []
    blocks = load_int4_blocks(model_dir)
    for weights, int4_codes in [(w, None) for w in FORMATS] + ([("int4", blocks)] if blocks else []):
        source = "gguf blocks" if int4_codes else "quantized"
        model = copy.deepcopy(reference_model)
        store_weights(model, weights, torch.float32, int4_codes)  # consumes int4_codes
        logits = model(ids, positions, DenseAttention(reference_model.args))  # [T, V]
        agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        kl = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="batchmean")
        rows.append({"weights": weights, "from": source,
                     "top1_agreement": agreement, "mean_kl": kl.item()})
        print(rows[-1], flush=True)
    result = {"command": " ".join(["bench/weights_agreement.py", *sys.argv[1:]]), "model": str(model_dir),
              "tokens": len(ids), "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{model_dir.name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
