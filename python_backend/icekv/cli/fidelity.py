"""`icekv fidelity`: teacher-forced fidelity of decode policies against the full cache over one
prompt's long output (:mod:`icekv.eval.fidelity`)."""

from __future__ import annotations

from icekv.cli.common import _csv, _device_settings, _icecache_config, _kv_dtype, _timed
from icekv.errors import IcekvError


def _cmd_fidelity(args) -> int:
    from icekv.config.engine import EngineConfig
    from icekv.config.paging import PagingConfig
    from icekv.config.request import SamplingConfig
    from icekv.config.selection import SelectionConfig
    from icekv.engine import Engine
    from icekv.eval.fidelity import DECISIVE_PROBABILITY, REPEAT_RUN_TOKENS, reference, teacher_forced
    from icekv.eval.report import fidelity_line, write_fidelity_report
    from icekv.policies import resolve

    icecache = _icecache_config(args)
    full = resolve(SelectionConfig(policy="full"))
    plans = {}  # (policy, budget) -> its plan; the full cache once, whatever the budgets
    for policy in _csv("--policies", args.policies, str):
        for budget in _csv("--budgets", args.budgets, int):
            plan = resolve(SelectionConfig(policy=policy, budget=budget, icecache=icecache))
            plans[plan.name, plan.budget if plan.sparse else None] = plan
    sampling = SamplingConfig(max_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    text = _text(args)  # before the model loads: a bad file, haystack or setting fails at once
    paging = PagingConfig(kv_dtype=_kv_dtype(args))
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging, **_device_settings(args)))
    prompt = text if args.prompt_file is not None else _long_context(args, text, engine.tokenizer)
    if args.chat_template:
        prompt = engine.chat_prompt([{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(prompt)
    engine.check_fits(len(ids), args.new_tokens)

    def run(meta: dict) -> list[dict]:
        prefilled = engine.prefill(ids)
        try:
            ref = reference(engine, prefilled, sampling, full, args.top)
            meta.update(prompt_tokens=len(ids), output_tokens=len(ref.tokens), top=args.top, window=args.window,
                        sampled=None if sampling.greedy else {"temperature": sampling.temperature,
                                                              "top_p": sampling.top_p, "seed": sampling.seed},
                        reference_repeat_run=REPEAT_RUN_TOKENS, reference_repeated=ref.repeated(args.window),
                        decisive_probability=DECISIVE_PROBABILITY)
            records = []
            for (policy, budget), plan in plans.items():
                found = teacher_forced(engine, prefilled, ref, plan, probe=args.recall)
                records.append({"policy": policy, "budget": budget, "first_divergence": found.first_divergence,
                                **found.summary(), "windows": found.windows(args.window)})
                print(fidelity_line(records[-1]), flush=True)
                write_fidelity_report(records, args.out, meta)  # a long run's finished rows are kept as they come
            return records
        finally:
            engine.release(prefilled)

    records, meta = _timed(engine, run)
    write_fidelity_report(records, args.out, meta)
    print(f"wrote {args.out / 'results.json'}, report.md")
    return 0


def _text(args) -> str:
    """The prompt file's text, or the haystack's."""
    from icekv.assets import Assets

    if args.prompt_file is None:
        return Assets().haystack_text(args.haystack)
    if not args.prompt_file.is_file():
        raise IcekvError(f"--prompt-file {args.prompt_file} is not a readable file")
    prompt = args.prompt_file.read_text()
    if not prompt.strip():
        raise IcekvError(f"--prompt-file {args.prompt_file} is empty")
    return prompt


def _long_context(args, haystack: str, tokenizer) -> str:
    """The haystack's first ``--length`` tokens, then the request."""
    context = tokenizer.encode(haystack)
    if len(context) < args.length:
        raise IcekvError(f"--haystack {args.haystack} holds {len(context)} tokens, fewer than --length {args.length}")
    return tokenizer.decode(context[: args.length]) + "\n\n" + args.ask
