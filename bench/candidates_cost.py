"""What the centroids search's candidate count costs per decoded token: icecache on
Qwen2.5-Coder-0.5B at 16k and 32k tokens (fp32, CPU), under the floor of 96 and of 256 pages
rescored per query head (``--min-candidates``) and with every page scored (``--search
exhaustive``). The search is an engine setting, so each variant is one ``icekv bench decode``
process; the variants alternate over the rounds so that the machine's drift falls on each alike,
and the summary takes each one's median over the rounds. Run nothing else meanwhile. The accuracy
of each variant is in docs/benchmarks.md ("Candidates rescored").

    .venv/bin/python bench/candidates_cost.py [--budgets 64,256] [--rounds 2] [--out bench/results/candidates_cost]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "candidates96": ["--search", "centroids", "--min-candidates", "96"],
    "candidates256": ["--search", "centroids", "--min-candidates", "256"],
    "exhaustive": ["--search", "exhaustive"],
}
CONTEXTS = "16384,32768"


def run(variant: str, budget: int, out: Path) -> list[dict]:
    """One ``icekv bench decode`` process -> its records (one per context)."""
    subprocess.run([".venv/bin/icekv", "bench", "decode", "--model", "qwen2.5-coder-0.5b", "--contexts", CONTEXTS,
                    "--policies", "icecache", "--budget", str(budget), "--steps", "16", *VARIANTS[variant],
                    "--out", str(out)], check=True)
    return json.loads((out / "results.json").read_text())["records"]


def summary(times: dict[tuple[str, int, int], list[dict]], command: str) -> str:
    """(variant, budget, context) -> each round's record  ->  a Markdown table of medians."""
    lines = ["# Candidate count: cost per decoded token", "", "```", command, "```", "",
             "Median over the rounds; select is the page search's share of the token's time.", "",
             "| budget | context | variant | TPOT ms | select ms | index build s |", "|---|---|---|---|---|---|"]
    for (variant, budget, context), records in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
        lines.append(f"| {budget} | {context} | {variant} | {med('tpot_s') * 1e3:.1f} | {med('select_s') * 1e3:.1f} "
                     f"| {med('index_build_s'):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="64,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/candidates_cost"))
    args = p.parse_args()
    times: dict[tuple[str, int, int], list[dict]] = {}
    for r in range(args.rounds):
        for budget in map(int, args.budgets.split(",")):
            for variant in VARIANTS:
                for record in run(variant, budget, args.out / f"{variant}_b{budget}_r{r + 1}"):
                    times.setdefault((variant, budget, record["context"]), []).append(record)
    text = summary(times, " ".join([".venv/bin/python", *sys.argv]))
    (args.out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
