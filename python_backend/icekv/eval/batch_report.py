"""Write ``icekv bench batch``'s results.json, report.md and throughput.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from icekv.eval.report import plot_lines


def write_batch_report(records: list[dict], out: Path, meta: dict) -> None:
    """Per (context, batch, policy): tokens/s, step latency and split, scaling vs batch 1."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    ms = lambda x: f"{1000 * x:.1f}"
    single = {(r["context"], r["policy"]): r for r in records if r["batch"] == 1}
    lines = ["# icekv bench batch", "", "```", meta.get("command", ""), "```", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "command"] + [""]
    repeats = records[0].get("repeats", 1) if records else 1
    lines += ["Per step (all the batch's requests): median and p99 latency, and the mean split; "
              "'dense + other' is the step less selection, transfer, attention and insertion."
              + (f" Each row is the median of {repeats} interleaved runs; 'vs batch 1' is the median of the "
                 "runs' ratios, each to the batch-1 run of the same pass." if repeats > 1 else ""), "",
              "| context | batch | policy | tokens/s | vs batch 1 | step median ms | step p99 ms | first step ms | "
              "dense + other ms | select ms | transfer ms | attention ms | insert ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        base = single.get((r["context"], r["policy"]))
        scale = f"{vs_batch_1(r, base):.2f}x" if base else "-"
        lines.append(f"| {r['context']} | {r['batch']} | {r['policy']} | {r['tokens_per_s']:.1f} | {scale} | "
                     f"{ms(r['step_median_s'])} | {ms(r['step_p99_s'])} | {ms(r['first_step_s'])} | "
                     f"{ms(r['dense_other_s'])} | {ms(r['select_s'])} | {ms(r['transfer_s'])} | "
                     f"{ms(r['attention_s'])} | {ms(r['insert_s'])} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    series = {}
    for context, policy in sorted({(r["context"], r["policy"]) for r in records}):
        rs = sorted((r for r in records if r["context"] == context and r["policy"] == policy), key=lambda r: r["batch"])
        series[f"{policy} {context}"] = ([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs])
    plot_lines(series, "requests decoding together", "aggregate decode tokens/s", out / "throughput.png")


def vs_batch_1(record: dict, single: dict) -> float:
    """A record's throughput over its batch-1 record's: the median of the paired runs' ratios when
    both were repeated (a pass's runs are close in time, so the machine's drift cancels), else the
    ratio of the two."""
    runs, base = record.get("tokens_per_s_runs"), single.get("tokens_per_s_runs")
    if runs and base and len(runs) == len(base):
        return statistics.median(a / b for a, b in zip(runs, base))
    return record["tokens_per_s"] / single["tokens_per_s"]
