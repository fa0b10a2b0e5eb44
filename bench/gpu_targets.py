"""Read what bench/gpu_check.sh wrote and set it against the CUDA targets of the device mode:
each target measured or missing, met or not, and the split of IceCache's time per token (what
bounds it). Runs at the end of the check and on an unpacked archive:

    python bench/gpu_targets.py bench/results/gpu/<date>-<commit>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TPOT_32K_S = 0.030  # icecache, Llama-3.1-8B shape, bf16, batch 1, budget 256
VS_FULL_128K, VS_HF_128K = 0.6, 0.5  # icecache TPOT at 128k as a share of full's and of transformers'
BATCH_GAIN = 2.0  # icecache aggregate tokens/s at 8 x 32k over full attention's
PARTS = ("decode_32k.txt", "decode_128k.txt", "batch_32k.txt", "decode_32k_rescoring.txt")


def read_lines(folder: Path, name: str) -> list[dict]:
    """One part's output: a JSON file with its records, or JSON lines (one per plan, record,
    error and meta, written as measured: a part cut short keeps what it measured)."""
    try:
        text = (folder / name).read_text()
    except OSError:
        return []
    try:
        whole = json.loads(text)
        return whole.get("records", []) if isinstance(whole, dict) else []
    except ValueError:
        pass
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return [x for x in out if isinstance(x, dict)]


def records(folder: Path, name: str) -> list[dict]:
    """The measured records of one part; [] when it measured none."""
    return [x for x in read_lines(folder, name) if not {"plan", "meta", "error"} & set(x)]


def errors(folder: Path, name: str) -> list[str]:
    """Policy groups of one part that failed, and why."""
    return [f"{name}: {'+'.join(x.get('policies', []))} failed: {x['error']}" for x in read_lines(folder, name) if "error" in x]


def pick(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def verdict(name: str, value: float | None, limit: float, unit: str = "", higher_is_better: bool = False) -> str:
    if value is None:
        return f"{name}: not measured"
    met = value >= limit if higher_is_better else value <= limit
    bound = f"{'>=' if higher_is_better else '<='} {limit:g}{unit}"
    return f"{name}: {value:.4g}{unit} ({bound}: {'met' if met else 'MISSED'})"


def split(row: dict) -> str:
    parts = ("select_s", "transfer_s", "attention_s", "insert_s", "other_s")
    return ", ".join(f"{p.removesuffix('_s')} {row.get(p, 0) * 1e3:.2f} ms" for p in parts)


def parity(folder: Path) -> str:
    """Engine parity, CPU vs CUDA: every check passed, or which failed."""
    try:
        checks = json.loads((folder / "engine_parity.json").read_text())["checks"]
    except (OSError, ValueError, KeyError):
        return "engine parity CPU vs CUDA: not measured"
    failed = [c["check"] for c in checks if not c["passed"]]
    return (f"engine parity CPU vs CUDA: {len(checks) - len(failed)} of {len(checks)} checks passed"
            + (f" (MISSED: {'; '.join(failed)})" if failed else " (met)"))


def report(folder: Path) -> list[str]:
    # each part's records whatever its context: the dry run's parts are the same at shrunk shapes
    d32, d128 = records(folder, "decode_32k.txt"), records(folder, "decode_128k.txt")
    lines = [parity(folder)]
    ice32 = pick(d32, policy="icecache")
    lines.append(verdict("icecache TPOT at 32k", ice32 and ice32["tpot_s"], TPOT_32K_S, " s"))
    if ice32 and "tpot_median_s" in ice32:
        lines.append(f"  steady state (median of the timed steps): {ice32['tpot_median_s']:.4g} s")
    rescored32 = pick(records(folder, "decode_32k_rescoring.txt"), policy="icecache")
    lines.append(verdict("icecache TPOT at 32k, candidates rescored on the device", rescored32 and rescored32["tpot_s"],
                         TPOT_32K_S, " s"))
    ice128, full128 = pick(d128, policy="icecache"), pick(d128, policy="full")
    hf128 = pick(d128, policy="hf_transformers")
    lines.append(verdict("icecache / full TPOT at 128k", ice128 and full128 and ice128["tpot_s"] / full128["tpot_s"],
                         VS_FULL_128K))
    lines.append(verdict("icecache / transformers TPOT at 128k",
                         ice128 and hf128 and ice128["tpot_s"] / hf128["tpot_s"], VS_HF_128K))
    batch = records(folder, "batch_32k.txt")
    most = max((r["batch"] for r in batch), default=8)  # 8 on the GPU
    ice8, full8 = pick(batch, batch=most, policy="icecache"), pick(batch, batch=most, policy="full")
    lines.append(verdict("icecache / full tokens/s at 8 x 32k",
                         ice8 and full8 and ice8["tokens_per_s"] / full8["tokens_per_s"], BATCH_GAIN,
                         higher_is_better=True))
    if ice32 and ice128:
        growth = [r.get("device_peak_growth_bytes") for r in (ice32, ice128)]
        lines.append(f"icecache device memory growth during decode, 32k -> 128k: "
                     f"{growth[0] / 2**20:.1f} -> {growth[1] / 2**20:.1f} MiB" if None not in growth
                     else "icecache device memory growth: not recorded")
    for name in PARTS:
        lines += errors(folder, name)
    for row, how in ((ice32, ""), (rescored32, ", rescoring on the device"), (ice128, "")):
        if row:
            lines.append(f"icecache at {row['context']}{how}: {row['tpot_s'] * 1e3:.2f} ms/token = {split(row)}")
    if ice8 and "mean_step_s" in ice8:  # the batch's requests select in turn: their selection times add up
        lines.append(f"icecache at 8 x 32k: {ice8['mean_step_s'] * 1e3:.2f} ms/step = "
                     f"{split({**ice8, 'other_s': ice8.get('dense_other_s', 0)})} (summed over the 8 requests)")
    scoring = records(folder, "centroid_scoring.json")
    for r in scoring:
        lines.append(f"centroids search, one layer at {r['context']}, {r.get('score_dtype')} keys: host "
                     f"{r['host_s'] * 1e3:.3f} ms, device ranking + host rescoring {r['device_s'] * 1e3:.3f} ms "
                     f"({r.get('rescored_per_head', 0):.0f} pages rescored per head), same pages {r['same_pages']:.0%}")
        if "device_rescoring_warm_s" in r:
            lines.append(f"  + rescoring on the device: warm {r['device_rescoring_warm_s'] * 1e3:.3f} ms, cold "
                         f"{r['device_rescoring_cold_s'] * 1e3:.3f} ms, same pages {r['same_pages_rescored']:.0%}")
    return lines


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results/gpu")
    print("\n".join(report(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
