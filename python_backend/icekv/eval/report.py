"""Write an evaluation's results.json, report.md (tables) and accuracy.png (accuracy vs budget)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def _fmt(x, pct=True, digits=3):
    return "-" if x is None else (f"{100 * x:.0f}%" if pct else f"{x:.{digits}f}")


def write_report(records: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out / "report.md").write_text(render_markdown(records, meta))
    plot_accuracy(records, out / "accuracy.png")


def render_markdown(records: list[dict], meta: dict) -> str:
    lines = ["# icekv eval", "", "```", meta.get("command", ""), "```", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "command"] + [""]
    by_task = defaultdict(list)
    for r in records:
        by_task[(r["task"], r["haystack"])].append(r)
    for (task, hay), rs in sorted(by_task.items()):
        lengths = sorted({r["length"] for r in rs})
        rows = sorted({(r["policy"], r["budget"] or 0) for r in rs}, key=lambda x: (x[0] != "full", x[0], x[1]))
        lines += [f"## {task} on {hay}", "",
                  "accuracy [95% interval] (ratio to full cache), n questions | attention recall | output cosine", ""]
        lines.append("| policy | budget | " + " | ".join(f"{n} tokens" for n in lengths) + " | recall | cosine |")
        lines.append("|---|---|" + "---|" * len(lengths) + "---|---|")
        for pol, bud in rows:
            cells, rec, cos = [], [], []
            for n in lengths:
                r = next((r for r in rs if r["policy"] == pol and (r["budget"] or 0) == bud and r["length"] == n), None)
                if r is None:
                    cells.append("-")
                    continue
                ratio = "" if r["ratio_to_full"] is None or pol == "full" else f" ({_fmt(r['ratio_to_full'])})"
                low, high = r["ci95"]
                cells.append(f"{_fmt(r['accuracy'])} [{_fmt(low)}-{_fmt(high)}]{ratio} n={r['n']}")
                if r["recall"] is not None:
                    rec.append(r["recall"])
                    cos.append(r["cosine"])
            mean = lambda xs: sum(xs) / len(xs) if xs else None
            lines.append(f"| {pol} | {bud or 'all'} | " + " | ".join(cells) + f" | {_fmt(mean(rec), False)} | {_fmt(mean(cos), False)} |")
        lines += ["", *_cost_table(rs, rows, lengths)]
    return "\n".join(lines)


def _cost_table(rs: list[dict], rows: list[tuple], lengths: list[int]) -> list[str]:
    """Time per token, its split (seconds per decode: summed over its steps, so they compare across
    policies at one length), the index build the first token waits for, and device residency."""
    out = ["time per token and its split (mean per decode; a probed run: its recall measurement adds to each step)", "",
           "| policy | budget | tokens | TPOT ms | select s | transfer s | attention s | index build s | device / total KV |",
           "|---|---|---|---|---|---|---|---|---|"]
    for pol, bud in rows:
        for n in lengths:
            r = next((r for r in rs if r["policy"] == pol and (r["budget"] or 0) == bud and r["length"] == n), None)
            if r is None:
                continue
            t = r["timings"]
            stage = lambda k: f"{t[k]:.3f}" if k in t else "-"
            share = r["resident_bytes"] / r["total_bytes"] if r["total_bytes"] else 0.0
            out.append(f"| {pol} | {bud or 'all'} | {n} | {r['tpot_s'] * 1e3:.0f} | {stage('select_s')} | "
                       f"{stage('transfer_s')} | {stage('attention_s')} | {stage('index_build_s')} | {share:.1%} |")
    return out + [""]


def plot_accuracy(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({(r["task"], r["haystack"]) for r in records})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, (task, hay) in zip(axes[0], tasks):
        rs = [r for r in records if r["task"] == task and r["haystack"] == hay]
        curves = defaultdict(lambda: defaultdict(list))
        for r in rs:
            curves[r["policy"]][r["budget"]].append((r["accuracy"], r["n"]))
        for pol, pts in sorted(curves.items()):
            mean = {b: sum(a * n for a, n in v) / sum(n for _, n in v) for b, v in pts.items()}
            if pol == "full":
                ax.axhline(mean[None], color="black", linestyle="--", label="full")
                continue
            xs = sorted(mean)
            ax.plot(xs, [mean[x] for x in xs], marker="o", label=pol)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per layer per KV head)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{task} / {hay} (all lengths)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_compression_report(records: list[dict], out: Path, meta: dict) -> None:
    """The reusable-context evaluation: accuracy (95% interval), compression cost beyond the
    prefill, memory and bytes per task, method and budget; accuracy.png per task."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    lines = ["# icekv eval: compressed reusable contexts", "", "```", meta.get("command", ""), "```", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "command"] + [""]
    lines += ["Accuracy is over every question asked (95% Wilson interval); compress s is the time beyond the "
              "context's prefill (shared by all rows), peak memory the growth beyond the prefilled cache.", "",
              "| task | length | method | kv budget | accuracy | 95% interval | n | prefill s | compress s | "
              "peak memory growth MiB | KV MiB (of full) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = lambda r: (r["task"], r["length"], r["method"] != "full", r["method"], r["kv_budget"])
    for r in sorted(records, key=order):
        low, high = r["ci95"]
        lines.append(f"| {r['task']} | {r['length']} | {r['method']} | {r['kv_budget']:.0%} | {_fmt(r['accuracy'])} | "
                     f"{low:.0%}-{high:.0%} | {r['n']} | {r['prefill_s']:.1f} | {r['compress_s']:.2f} | "
                     f"{r['peak_memory_growth_bytes'] / 2**20:.0f} | "
                     f"{r['kv_bytes'] / 2**20:.1f} ({r['kv_bytes'] / r['full_kv_bytes']:.1%}) |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in records})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        curves = defaultdict(dict)
        for r in records:
            if r["task"] == task:
                curves[r["method"]].setdefault(r["kv_budget"], []).append((r["accuracy"], r["n"]))
        for method, pts in sorted(curves.items()):
            mean = {b: sum(a * n for a, n in v) / sum(n for _, n in v) for b, v in pts.items()}
            if method == "full":
                ax.axhline(mean[1.0], color="black", linestyle="--", label="full")
                continue
            xs = sorted(mean)
            ax.plot(xs, [mean[x] for x in xs], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_title(task)
        ax.set_xlabel("KV budget (share of the context kept)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=100)
    plt.close(fig)


def write_decode_report(records: list[dict], out: Path, meta: dict) -> None:
    """Decode benchmark: per-token time split by stage, resident KV, ratios to full attention."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"
    full = {r["context"]: r for r in records if r["policy"] == "full"}
    lines = ["# icekv bench decode", "", "```", meta.get("command", ""), "```", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "command"] + [""]
    lines += ["| context | policy | TPOT ms | slowest step ms | first step ms | select ms | transfer ms | "
              "attention ms | insert ms | weights ms | other ms | index build s | TTFT s | resident KV MiB | "
              "total KV MiB | index MiB | TPOT / full |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        base = full.get(r["context"])
        ratio = f"{r['tpot_s'] / base['tpot_s']:.2f}" if base else "-"
        mib = lambda k: f"{r[k] / 2**20:.1f}" if k in r else "-"
        build = f"{r.get('index_build_s', 0):.2f}" + (" *" if r.get("index_prebuilt") else "")
        lines.append(f"| {r['context']} | {r['policy']} | {ms(r['tpot_s'])} | {ms(r.get('step_max_s'))} | "
                     f"{ms(r.get('first_step_s'))} | {ms(r.get('select_s'))} | {ms(r.get('transfer_s'))} | "
                     f"{ms(r.get('attention_s'))} | {ms(r.get('insert_s'))} | {ms(r.get('weights_s'))} | "
                     f"{ms(r.get('other_s'))} | {build} | "
                     f"{'-' if r.get('ttft_s') is None else format(r['ttft_s'], '.2f')} | {mib('resident_kv_bytes')} | "
                     f"{mib('total_kv_bytes')} | {mib('index_bytes')} | {ratio} |")
    if any(r.get("index_prebuilt") for r in records):
        lines += ["", "\\* index built layer by layer during prefill: the time shown is what was left to wait "
                  "for after it"]
    lines += _window_tables(records)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    series = {}
    for policy in sorted({r["policy"] for r in records}):
        rs = sorted((r for r in records if r["policy"] == policy), key=lambda r: r["context"])
        series[policy] = ([r["context"] for r in rs], [1000 * r["tpot_s"] for r in rs])
    plot_lines(series, "context tokens", "ms per output token", out / "tpot.png")


def fidelity_line(r: dict) -> str:
    """One policy's fidelity record in a line."""
    recall = "" if r["recall"] is None else f", selection recall {r['recall']:.3f}"
    decisive = _fmt(r["decisive_agreement"], pct=False)
    return (f"{_policy_at(r)}: top-1 agreement {r['agreement']:.3f} ({decisive} where the full cache is decisive), "
            f"KL {r['kl']:.4f} nats{recall}, first divergence at {_first_divergence(r)}")


def write_fidelity_report(records: list[dict], out: Path, meta: dict) -> None:
    """Teacher-forced fidelity: results.json, and report.md with a table per measure (a row per
    policy and budget, a column per window of output positions)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    starts = [w["start"] for w in records[0]["windows"]] if records else []
    lines = ["# Teacher-forced fidelity against the full cache", "", "```", meta.get("command", ""), "```", "",
             f"{meta['model']}: a {meta['prompt_tokens']}-token prompt, the full cache's {_decoding(meta)} output of "
             f"{meta['output_tokens']} tokens fed back under each policy. Agreement: the policy's most likely "
             "token is the full cache's; first divergence: the first position where they differ. "
             "KL(full || policy) over the full cache's "
             f"top {meta['top']} tokens and the rest (a lower bound of the exact KL). Position 0 comes from the "
             "prefill under every policy.", ""]
    decisive = (f"top-1 agreement at the decisive positions (the full cache's favourite holds >= "
                f"{meta['decisive_probability']})")
    measures = (("agreement", "top-1 agreement", 3), ("kl", "mean KL, nats", 4), ("decisive_agreement", decisive, 3),
                ("decisive_share", "share of decisive positions", 3))
    if any(r["recall"] is not None for r in records):
        measures += (("recall", "selection recall (full attention's mass on the attended tokens)", 3),)
    for measure, unit, digits in measures:
        lines += [f"## {unit}, per window of {meta['window']} output positions", "",
                  "| policy | budget | first divergence | all | " + " | ".join(f"{s}-" for s in starts) + " |",
                  "|---|---|---|---|" + "---|" * len(starts)]
        for r in records:
            cells = [_fmt(v, pct=False, digits=digits) for v in [r[measure]] + [w[measure] for w in r["windows"]]]
            budget = "-" if r["budget"] is None else r["budget"]
            lines.append(f"| {r['policy']} | {budget} | {_first_divergence(r)} | " + " | ".join(cells) + " |")
        lines.append("")
    if meta.get("reference_repeated"):
        lines += ["The full cache's output, per window: the share of positions whose token ends a run of "
                  f"{meta['reference_repeat_run']} tokens that already ended earlier in it (near 1: the output "
                  "repeats itself, and any policy that keeps recent tokens follows it): "
                  + ", ".join(f"{v:.2f}" for v in meta["reference_repeated"]) + ".", ""]
    (out / "report.md").write_text("\n".join(lines))


def _decoding(meta: dict) -> str:
    """How the full cache's output was decoded: greedy, or sampled with its settings."""
    s = meta.get("sampled")
    return "greedy" if s is None else f"sampled (temperature {s['temperature']}, top-p {s['top_p']}, seed {s['seed']})"


def _policy_at(r: dict) -> str:
    return r["policy"] if r["budget"] is None else f"{r['policy']}@{r['budget']}"


def _first_divergence(r: dict) -> str:
    return "never" if r["first_divergence"] is None else str(r["first_divergence"])


def _window_tables(records: list[dict]) -> list[str]:
    """A long output's windows, one table per record that has them."""
    lines = []
    for r in (r for r in records if r.get("windows")):
        lines += ["", f"## {r['policy']} at {r['context']} tokens, per window of the output", "",
                  "| output steps | TPOT ms | median ms | slowest ms | select ms | transfer ms | attention ms | "
                  "insert ms | KV bytes / token | index bytes / token | index MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for w in r["windows"]:
            ms = lambda k: f"{1000 * w[k]:.1f}"  # noqa: E731
            lines.append(f"| {w['start']}-{w['start'] + w['steps'] - 1} | {ms('tpot_s')} | {ms('tpot_median_s')} | "
                         f"{ms('step_max_s')} | {ms('select_s')} | {ms('transfer_s')} | {ms('attention_s')} | "
                         f"{ms('insert_s')} | {w['kv_bytes_per_token']:,.0f} | {w['index_bytes_per_token']:,.0f} | "
                         f"{w['index_bytes'] / 2**20:.1f} |")
    return lines


def plot_lines(series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, path: Path) -> None:
    """One line per label over a log2 x axis, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
