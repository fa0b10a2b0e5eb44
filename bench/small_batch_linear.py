"""A decode step's dense products on a CPU, in the forms of ``icekv.model.linear``: ``F.linear``
(``x @ W.T``), the weight-streaming ``(W @ x.T).T`` and the compiled loop (timed up to twice the
rows the model gives it), for each number of rows (requests in the step). The weights have a model's shapes (every layer's q/k/v/o and MLP matrices, then the output
head), fp32, random: only their size matters. The forms alternate repeat by repeat, so that the
machine's drift falls on all alike.

    .venv/bin/python bench/small_batch_linear.py [--model smollm2-135m] [--rows 1,2,4,8,16,64,256]
        [--repeats 6] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from icekv.engine.model_dir import resolve_model_dir
from icekv.model.args import ModelArgs
from icekv.model.linear import COMPILED_ROWS, compiled_linear, streamed_linear

FORMS = {"F.linear": lambda x, w: F.linear(x, w), "streamed": lambda x, w: streamed_linear(x, w, None),
         "compiled": lambda x, w: compiled_linear(x, w, None)}
MOST_ROWS = {"compiled": 2 * COMPILED_ROWS}  # beyond this the form is compute-bound: not timed


def weight_shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """(out, in) of every matrix a decode step multiplies, in order."""
    h, inter, d = args.hidden_size, args.intermediate_size, args.head_dim
    q, kv = args.num_heads * d, args.num_kv_heads * d
    layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    return layer * args.num_layers + [(args.vocab_size, h)]


def time_forms(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> dict[tuple[int, str], list[float]]:
    """(rows, form) -> each repeat's seconds for one pass over every weight."""
    compiled_linear(torch.zeros(1, shapes[0][1]), torch.zeros(shapes[0]), None)  # compiled before timing
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) for o, i in shapes]
    inputs = {n: {i: torch.randn(n, i, generator=g) for i in {i for _, i in shapes}} for n in rows}
    seconds: dict[tuple[int, str], list[float]] = {}
    for r in range(repeats):
        order = list(FORMS) if r % 2 == 0 else list(reversed(FORMS))
        for n in rows:
            for form in order:
                if n > MOST_ROWS.get(form, n):
                    continue
                t0 = time.perf_counter()
                for w in weights:
                    FORMS[form](inputs[n][w.shape[1]], w)
                seconds.setdefault((n, form), []).append(time.perf_counter() - t0)
    return seconds


def report(seconds: dict[tuple[int, str], list[float]], model: str, weight_bytes: int, command: str) -> str:
    repeats = len(next(iter(seconds.values())))
    lines = [f"# A decode step's dense products, {model} shapes ({weight_bytes / 2**20:.0f} MiB fp32)", "",
             "```", command, "```", "",
             f"torch threads {torch.get_num_threads()}; median of {repeats} interleaved repeats, ms per pass over "
             "every weight; GB/s = weight bytes read per second", "",
             "| rows | F.linear ms | streamed ms | compiled ms | best / F.linear | best GB/s |", "|---|---|---|---|---|---|"]
    for n in sorted({n for n, _ in seconds}):
        ms = {form: statistics.median(seconds[(n, form)]) * 1e3 for form in FORMS if (n, form) in seconds}
        best = min(ms.values())
        cells = " | ".join(f"{ms[form]:.1f}" if form in ms else "-" for form in FORMS)
        lines.append(f"| {n} | {cells} | {best / ms['F.linear']:.2f}x | {weight_bytes / best / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a known model's name or a model folder")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    try:
        rows = [int(n) for n in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if args.repeats < 1 or min(rows) < 1:
        parser.error("--rows and --repeats must be >= 1")
    shapes = weight_shapes(ModelArgs.from_dir(resolve_model_dir(args.model)))
    seconds = time_forms(shapes, rows, args.repeats)
    text = report(seconds, args.model, 4 * sum(o * i for o, i in shapes),
                  "bench/small_batch_linear.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
