"""Which needles a sparse decode attended at each step: is a wrong answer a needle lost partway
through its value, or never found?

Rebuilds one context of an ``icekv eval`` log (its seed and grid settings), prefills it, and
decodes the chosen questions under one (policy, budget) with the probe on. At every decode step
and budgeted layer the probe knows which tokens each query head attended; this reports, per
generated token, the share of (budgeted layer, query head) pairs whose attended tokens include
the asked needle's sentence (and its value's tokens), and the same for the best-covered other
needle. Under icecache a KV head's query heads attend its pages together, so this is also the
share of (layer, KV head) pairs. Multi-question niah contexts only (``--questions`` > 1 in the log).

    .venv/bin/python bench/needle_pages.py RUNS_JSONL CONTEXT QUESTION[,QUESTION...] \
        [--model qwen2.5-coder-0.5b] [--policy icecache] [--budget 64] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.engine.backends.sparse import SparseAttention
from icekv.eval.needles import find_needles
from icekv.eval.tasks import QUESTION_ROOM, HaystackSampler, PromptFormat


def read_context(log: Path, key: str) -> tuple[dict, dict]:
    """The log's grid settings and the entry of context ``key`` (task/length/sample)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    entries = {e["context"]: e for e in lines[1:]}
    if key not in entries:
        raise SystemExit(f"{log}: no context {key!r}; it holds {', '.join(entries)}")
    return lines[0]["config"], entries[key]


def needle_spans(context: str, encode) -> dict[str, tuple[int, int, int]]:
    """value -> token positions (a, v, b) of its needle sentence in the encoded context: the
    sentence is [a, b), its value [v, b). Every needle: the asked ones and the distractors."""
    at = lambda i: len(encode(context[:i].rstrip()))  # noqa: E731  (a space may join the next word's token)
    return {m["value"]: (at(m.start()), at(m.start("value")), at(m.end())) for m in find_needles(context)}


class AttendedLog:
    """Records what the probe saw: per call (one budgeted layer of one decode step) the [Hq, T]
    mask of attended tokens."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor]] = []
        self._original = SparseAttention._record_probe

    def __enter__(self) -> AttendedLog:
        log, original = self, self._original

        def record(backend, layer, q, out, attended, length):
            log.calls.append((layer, attended.clone()))
            return original(backend, layer, q, out, attended, length)

        SparseAttention._record_probe = record
        return self

    def __exit__(self, *exc) -> None:
        SparseAttention._record_probe = self._original

    def steps(self) -> list[list[torch.Tensor]]:
        """The calls grouped by decode step (a step visits the budgeted layers in order)."""
        out, last = [], None
        for layer, mask in self.calls:
            if last is None or layer <= last:
                out.append([])
            out[-1].append(mask)
            last = layer
        return out


def coverage(step: list[torch.Tensor], a: int, b: int) -> float:
    """Share of (layer, query head) pairs of a step that attended any token of [a, b)."""
    return sum(mask[:, a:b].any(-1).float().mean().item() for mask in step) / len(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("context", help="task/length/sample, as the log names it")
    ap.add_argument("questions", help="comma-separated question indices of that context")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--policy", default="icecache")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    grid, entry = read_context(args.log, args.context)
    task, length, _ = entry["context"].split("/")
    if grid.get("chat_template") or grid["questions"] < 2 or task not in ("niah_single", "niah_multikey"):
        raise SystemExit("only logs of niah_single / niah_multikey with several questions per context, "
                         "without the chat template, are replayed here")
    length = int(length)
    engine = Engine(EngineConfig(model_dir=args.model, paging=PagingConfig(
        pool_tokens=max(PagingConfig.pool_tokens, length + QUESTION_ROOM + 64))))
    encode = engine.tokenizer.encode
    sampler = HaystackSampler(Assets().haystack_text(grid["haystack"]), engine.tokenizer)
    sample = sampler.make_context(task, length, entry["seed"], grid["questions"], None, grid["num_needles"],
                                  grid["num_values"], grid["num_hops"], grid.get("distinct_key_words", False))
    form = PromptFormat()
    spans = needle_spans(form.context(sample.context), encode)
    selection = SelectionConfig(policy=args.policy, budget=args.budget, icecache=IceCacheConfig(**grid["icecache"]))
    req = engine.prefill(encode(form.context(sample.context)))
    lines = [f"`{args.log}` {args.context}, {args.policy} @{args.budget}: per generated token, the share of "
             "(budgeted layer, query head) pairs that attended the asked needle's sentence, and the best-covered "
             "other needle's", ""]
    try:
        for q in map(int, args.questions.split(",")):
            question = sample.questions[q]
            logged = [r for r in entry["runs"] if r["question"] == q]
            if question.answers != tuple(logged[0]["expected"]):
                raise SystemExit(f"rebuilt question {q} expects {question.answers}, the log {logged[0]['expected']}")
            with AttendedLog() as seen:
                limit = question.tokens_to_decode(grid["max_tokens"])  # as the eval decoded it
                gen = engine.decode(req, SamplingConfig(max_tokens=limit, stop=question.stop), selection,
                                    probe=True, suffix=encode(form.question(question.text)))
            right = question.answers[0]
            lines += [f"question {q}: expected {right}, answered {gen.text.strip()!r} ({len(seen.steps())} "
                      f"probed steps, {len(gen.token_ids)} tokens, {len(spans)} needles)", "",
                      "| step | token | asked needle | its value | best other needle | which |",
                      "|---|---|---|---|---|---|"]
            # token 0 comes from the question's prefill (full attention); step i produced token i + 1
            for i, step in enumerate(seen.steps()):
                if i + 1 >= len(gen.token_ids):
                    break
                others = {v: coverage(step, a, b) for v, (a, _, b) in spans.items() if v != right} or {"-": 0.0}
                best = max(others, key=others.get)
                token = engine.tokenizer.decode([gen.token_ids[i + 1]])
                a, v, b = spans[right]
                lines.append(f"| {i + 1} | {token!r} | {coverage(step, a, b):.2f} | {coverage(step, v, b):.2f} "
                             f"| {others[best]:.2f} | {best} |")
            lines.append("")
    finally:
        engine.release(req)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(f"```\n.venv/bin/python bench/needle_pages.py {args.log} {args.context} {args.questions} "
                            f"--model {args.model} --policy {args.policy} --budget {args.budget}\n```\n\n{text}\n")


if __name__ == "__main__":
    main()
