"""`icekv fidelity`: teacher-forced fidelity of decode policies against the full cache over one
prompt's long output (:mod:`icekv.eval.fidelity`)."""

from __future__ import annotations

import json

from icekv.cli.common import _csv, _device_settings, _icecache_config, _kv_dtype, _timed
from icekv.errors import IcekvError


def _cmd_fidelity(args) -> int:
    from icekv.config.engine import EngineConfig
    from icekv.config.paging import PagingConfig
    from icekv.config.selection import SelectionConfig
    from icekv.engine import Engine
    from icekv.eval.fidelity import reference, teacher_forced
    from icekv.policies import resolve

    icecache = _icecache_config(args)
    full = resolve(SelectionConfig(policy="full"))
    plans = {}  # (policy, budget) -> its plan; the full cache once, whatever the budgets
    for policy in _csv("--policies", args.policies, str):
        for budget in _csv("--budgets", args.budgets, int):
            plan = resolve(SelectionConfig(policy=policy, budget=budget, icecache=icecache))
            plans[plan.name, plan.budget if plan.sparse else None] = plan
    paging = PagingConfig(kv_dtype=_kv_dtype(args))
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging, **_device_settings(args)))
    prompt = _prompt(args, engine.tokenizer)
    if args.chat_template:
        prompt = engine.chat_prompt([{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(prompt)
    engine.check_fits(len(ids), args.new_tokens)

    def run(meta: dict) -> list[dict]:
        prefilled = engine.prefill(ids)
        try:
            ref = reference(engine, prefilled, args.new_tokens, full, args.top)
            if not ref.tokens:
                raise IcekvError("the full cache's answer is empty (an end-of-sequence token first): nothing to compare")
            meta.update(prompt_tokens=len(ids), output_tokens=len(ref.tokens), top=args.top, window=args.window)
            records = []
            for (policy, budget), plan in plans.items():
                found = teacher_forced(engine, prefilled, ref, plan)
                records.append({"policy": policy, "budget": budget, "first_divergence": found.first_divergence,
                                "agreement": float(found.agrees.double().mean()), "kl": float(found.kl.mean()),
                                "windows": found.windows(args.window)})
                print(_row(records[-1]), flush=True)
                _write(args.out, records, meta)  # a long run's finished rows are kept as they come
            return records
        finally:
            engine.release(prefilled)

    records, meta = _timed(engine, run)
    _write(args.out, records, meta)
    print(f"wrote {args.out / 'results.json'}, report.md")
    return 0


def _write(out, records: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out / "report.md").write_text(_report(records, meta))


def _prompt(args, tokenizer) -> str:
    """The prompt file's text, or the haystack's first ``--length`` tokens and the request."""
    from icekv.assets import Assets

    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise IcekvError(f"--prompt-file {args.prompt_file} is not a readable file")
        prompt = args.prompt_file.read_text()
        if not prompt.strip():
            raise IcekvError(f"--prompt-file {args.prompt_file} is empty")
        return prompt
    context = tokenizer.encode(Assets().haystack_text(args.haystack))
    if len(context) < args.length:
        raise IcekvError(f"--haystack {args.haystack} holds {len(context)} tokens, fewer than --length {args.length}")
    return tokenizer.decode(context[: args.length]) + "\n\n" + args.ask


def _row(r: dict) -> str:
    first = "never" if r["first_divergence"] is None else str(r["first_divergence"])
    name = r["policy"] if r["budget"] is None else f"{r['policy']}@{r['budget']}"
    return f"{name}: top-1 agreement {r['agreement']:.3f}, KL {r['kl']:.4f} nats, " \
           f"greedy would part at {first}"


def _report(records: list[dict], meta: dict) -> str:
    """One table per measure: a row per policy and budget, a column per window of output positions."""
    starts = [w["start"] for w in records[0]["windows"]] if records else []
    lines = ["# Teacher-forced fidelity against the full cache",
             "",
             f"{meta['model']}: a {meta['prompt_tokens']}-token prompt, the full cache's greedy output of "
             f"{meta['output_tokens']} tokens fed back under each policy. KL(full || policy) over the full "
             f"cache's top {meta['top']} tokens and the rest (a lower bound of the exact KL).",
             ""]
    for measure, unit in (("agreement", "top-1 agreement"), ("kl", "mean KL, nats")):
        lines += [f"## {unit}, per window of {meta['window']} output positions", "",
                  "| policy | budget | first divergence | all | " + " | ".join(f"{s}-" for s in starts) + " |",
                  "|---|---|---|---|" + "---|" * len(starts)]
        for r in records:
            first = "never" if r["first_divergence"] is None else str(r["first_divergence"])
            cells = [f"{w[measure]:.3f}" if measure == "agreement" else f"{w[measure]:.4f}" for w in r["windows"]]
            total = f"{r[measure]:.3f}" if measure == "agreement" else f"{r[measure]:.4f}"
            budget = "-" if r["budget"] is None else r["budget"]
            lines.append(f"| {r['policy']} | {budget} | {first} | {total} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
