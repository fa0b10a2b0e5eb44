"""An agent loop through the OpenAI API and the official ``openai`` client: a tool-using
conversation over a long document, under full attention and under a sparse policy, turn by turn.

The first user message holds a document (essays with keyed needles, as ``icekv eval`` makes them).
Each needle takes two turns:

- a **call** turn: the user asks for the key's number and the model must call ``record_number``
  (forced by ``tool_choice``: the small models would often answer without it) with the number it
  reads from the document; the harness records it and appends the tool's reply;
- an **answer** turn: the user asks for a long reply about the essay around the needle, with tools
  offered but not to be called (``tool_choice: none``, the servers set to show them anyway:
  ``tools_shown_when_none``, so that every turn's prompt continues the previous one), up to
  ``--answer-tokens`` tokens.

Every turn resends the whole conversation and streams its reply. The full-attention loop runs
first and keeps its own history. The policy's loop then sends, at each turn, the full loop's
history up to that turn, so that each reply is compared with full attention's on the same prompt:
the call's arguments, whether the number is the needle's, and for an answer the tokens the two
replies share from their start. Each loop has a server of its own with the prefix cache on, so a
turn continues the previous turn's pages, and under the policy its page index. Reported per turn:
prompt and cached tokens, time to the first streamed chunk, time per output token after it.

    .venv/bin/python bench/agent_loop.py [--model qwen2.5-coder-0.5b] [--length 16000] [--turns 20] \
        [--policy icecache] [--answer-tokens 400] [--out bench/results/agent_loop_<model>_<policy>]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import openai
import torch

from icekv.assets import Assets
from icekv.eval.needles import find_needles
from icekv.eval.tasks import HaystackSampler, make_reusable
from icekv.model import Tokenizer
from icekv.serving.launcher import TritonServer, free_port
from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.openai.process import OpenAIFrontendProcess

RECORD = {"type": "function", "function": {
    "name": "record_number", "description": "Record the special magic number the document gives for a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "number": {"type": "integer"}},
                   "required": ["key", "number"]}}}
FORCED = {"type": "function", "function": {"name": "record_number"}}
SYSTEM = "You are a careful research assistant. You read the document the user gives you and use your tools."


def call_turn(key: str) -> str:
    return f"What is the special magic number for {key} in the document? Record it with record_number."


def answer_turn(key: str) -> str:
    return (f"Now write a long, detailed summary of the essay in the document where the number for {key} appears: "
            "its argument, its examples and its conclusion, in several paragraphs.")


def ask(client: openai.OpenAI, messages: list[dict], **extra) -> dict:
    """One streamed turn: its content, tool call, usage and timings."""
    t0 = time.perf_counter()
    first = last = None
    content, name, arguments, call_id, usage = [], None, [], None, None
    stream = client.chat.completions.create(model="icekv", messages=messages, tools=[RECORD], temperature=0,
                                            stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            pieces = [delta.content] if delta.content else []
            for call in delta.tool_calls or ():
                call_id = call.id or call_id
                if call.function is not None:
                    name = call.function.name or name
                    if call.function.arguments:
                        arguments.append(call.function.arguments)
                        pieces.append(call.function.arguments)
            if pieces:
                first = first if first is not None else time.perf_counter() - t0
                last = time.perf_counter() - t0
                content += [delta.content] if delta.content else []
    tokens = usage.completion_tokens
    if first is None:
        raise RuntimeError(f"the turn streamed no content and no call ({tokens} tokens)")
    return {"content": "".join(content), "call": {"name": name, "arguments": "".join(arguments), "id": call_id}
            if name else None, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "completion_tokens": tokens,
            "ttft_s": first, "tpot_ms": 1000 * (last - first) / (tokens - 1) if tokens > 1 else None}


def recorded(turn: dict) -> int | None:
    """The number a call turn recorded, None if its call does not parse."""
    try:
        return int(json.loads(turn["call"]["arguments"])["number"])
    except (TypeError, KeyError, ValueError, json.JSONDecodeError):
        return None


def shared_tokens(tokenizer: Tokenizer, a: str, b: str) -> int:
    """How many tokens two replies share from their start."""
    x, y = tokenizer.encode(a), tokenizer.encode(b)
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


class Loop:
    """One server with ``policy``; ``run`` plays the conversation, following ``forced`` (the full loop's
    turns) where given, else its own replies."""

    def __init__(self, model_dir: Path, policy: str, pool_tokens: int, work: Path):
        self.policy = policy
        self.server = TritonServer({"model_dir": str(model_dir), "policy": policy, "pool_tokens": str(pool_tokens),
                                    "max_active_requests": "1", "tools_shown_when_none": "true"},
                                   log_path=work / f"tritonserver_{policy}.log")
        config = OpenAIConfig(triton_grpc_url=self.server.grpc_url, port=free_port(), idle_timeout_s=600)
        self.frontend = OpenAIFrontendProcess(config, log_path=work / f"frontend_{policy}.log")

    def run(self, document: str, keys: list[str], answer_tokens: int, forced: list[dict] | None = None) -> list[dict]:
        self.server.start()
        try:
            self.frontend.start()
            client = openai.OpenAI(base_url=f"{self.frontend.url}/v1", api_key="unused", max_retries=0, timeout=3600)
            ask(client, [{"role": "user", "content": "Hello"}], max_tokens=2)  # first-request costs
            return self._turns(client, document, keys, answer_tokens, forced)
        finally:
            self.frontend.stop()
            self.server.stop()

    def _turns(self, client, document: str, keys: list[str], answer_tokens: int, forced) -> list[dict]:
        messages, turns = [{"role": "system", "content": SYSTEM}], []
        for i, key in enumerate(keys):
            head = f"Here is a document.\n\n{document}\n\n" if i == 0 else ""
            messages.append({"role": "user", "content": head + call_turn(key)})
            turn = ask(client, messages, tool_choice=FORCED, max_tokens=48)
            turns.append({"kind": "call", "key": key, **turn})
            call = {"name": "record_number", "arguments": "{}", **((forced or turns)[len(turns) - 1]["call"] or {})}
            call["id"] = call.get("id") or f"call_{i}"  # a stream that named no id
            messages.append({"role": "assistant", "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                    "arguments": call["arguments"]}}]})
            number = recorded((forced or turns)[len(turns) - 1])
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"Recorded {key} = {number}." if number is not None else "No number given."})
            messages.append({"role": "user", "content": answer_turn(key)})
            turn = ask(client, messages, tool_choice="none", max_tokens=answer_tokens)
            turns.append({"kind": "answer", "key": key, **turn})
            messages.append({"role": "assistant", "content": (forced or turns)[len(turns) - 1]["content"]})
            print(f"{self.policy} {i + 1}/{len(keys)}: call {turns[-2]['call']}, answer {turn['completion_tokens']} "
                  f"tokens, ttft {turn['ttft_s']:.2f} s, tpot {turn['tpot_ms'] or 0:.1f} ms, "
                  f"{turn['cached_tokens']}/{turn['prompt_tokens']} cached", flush=True)
        return turns


def compare(full: list[dict], other: list[dict], values: dict[str, str], tokenizer: Tokenizer) -> list[dict]:
    """Per turn: each run's figures, and the policy's reply against full attention's."""
    rows = []
    for n, (f, o) in enumerate(zip(full, other), 1):
        row = {"turn": n, "kind": f["kind"], "key": f["key"], "full": f, "policy": o}
        if f["kind"] == "call":
            row.update(same_call=(f["call"] or {}).get("arguments") == (o["call"] or {}).get("arguments"),
                       full_correct=recorded(f) == int(values[f["key"]]),
                       policy_correct=recorded(o) == int(values[f["key"]]))
        else:
            row.update(identical=f["content"] == o["content"], full_tokens=f["completion_tokens"],
                       shared=shared_tokens(tokenizer, f["content"], o["content"]))
        rows.append(row)
    return rows


def report(result: dict) -> str:
    rows, policy = result["turns"], result["policy"]
    calls = [r for r in rows if r["kind"] == "call"]
    answers = [r for r in rows if r["kind"] == "answer"]
    later = rows[1:]

    def total(run: str, key: str) -> float:
        return sum(r[run][key] for r in later)

    def tpot(run: str) -> float:  # over every answer turn's tokens after its first
        timed = [r[run] for r in answers if r[run]["tpot_ms"] is not None]
        steps = sum(t["completion_tokens"] - 1 for t in timed)
        return sum(t["tpot_ms"] * (t["completion_tokens"] - 1) for t in timed) / steps if steps else float("nan")

    md = [f"# An agent loop over a {result['document_tokens']:,}-token document: full attention and {policy}", "",
          f"`{result['command']}` on {result['machine']}, commit {result['commit']}, {result['date']}.", "",
          f"{len(rows)} turns through the OpenAI API (official `openai` client, streamed, greedy): per needle a forced "
          "`record_number` call, its tool result, then a reply of at most "
          f"{result['answer_tokens']} tokens with the tools shown and `tool_choice: none` "
          f"(`tools_shown_when_none`). The {policy} run is teacher-forced on full attention's history; each "
          "server keeps its prefix cache.", "",
          "| turn | kind | prompt tokens | cached (full / policy) | first chunk s (full / policy) | "
          "ms per token (full / policy) | tokens | policy against full |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, o = r["full"], r["policy"]
        if r["kind"] == "call":
            verdict = (f"call {'same' if r['same_call'] else 'differs'}; number right: full "
                       f"{'yes' if r['full_correct'] else 'no'}, {policy} {'yes' if r['policy_correct'] else 'no'}")
        else:
            verdict = ("identical" if r["identical"] else f"first {r['shared']} of {r['full_tokens']} tokens shared")
        ms = lambda x: f"{x:.1f}" if x is not None and r["kind"] == "answer" else "-"  # noqa: E731
        md.append(f"| {r['turn']} | {r['kind']} | {f['prompt_tokens']:,} | {f['cached_tokens']:,} / "
                  f"{o['cached_tokens']:,} | {f['ttft_s']:.2f} / {o['ttft_s']:.2f} | {ms(f['tpot_ms'])} / "
                  f"{ms(o['tpot_ms'])} | {f['completion_tokens']} / {o['completion_tokens']} | {verdict} |")
    md += ["", "A call streams as one chunk: a call turn's first chunk is its whole call, with no time per token.",
           "", f"- Calls: the same arguments in {sum(r['same_call'] for r in calls)}/{len(calls)}; the needle's "
           f"number recorded by full attention in {sum(r['full_correct'] for r in calls)}/{len(calls)}, by {policy} "
           f"in {sum(r['policy_correct'] for r in calls)}/{len(calls)}.",
           f"- Answers: identical in {sum(r['identical'] for r in answers)}/{len(answers)}; "
           f"{sum(r['shared'] for r in answers):,} of {sum(r['full_tokens'] for r in answers):,} tokens shared from "
           "the start.",
           f"- Turns 2-{len(rows)}: first chunk {total('policy', 'ttft_s') / total('full', 'ttft_s'):.2f}x full "
           f"attention's (sums); per output token over the answers {tpot('full'):.1f} ms full, "
           f"{tpot('policy'):.1f} ms {policy} ({tpot('policy') / tpot('full'):.2f}x).",
           f"- Turn 1 (the document): first chunk {rows[0]['full']['ttft_s']:.1f} s full, "
           f"{rows[0]['policy']['ttft_s']:.1f} s {policy}."]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--length", type=int, default=16000, help="document tokens")
    ap.add_argument("--turns", type=int, default=20, help="two per needle: a call, then an answer")
    ap.add_argument("--policy", default="icecache")
    ap.add_argument("--answer-tokens", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.turns < 2 or args.turns % 2:
        ap.error("--turns must be an even number of at least 2 (a call and an answer per needle)")
    assets = Assets()
    model_dir = assets.model_dir(args.model)
    tokenizer = Tokenizer(model_dir)
    sample = make_reusable(HaystackSampler(assets.haystack_text("essays"), tokenizer), args.length, args.seed,
                           args.turns // 2)
    values = {m["key"]: m["value"] for m in find_needles(sample.context)}
    keys = list(values)
    out = args.out or Path(f"bench/results/agent_loop_{args.model}_{args.policy}")
    out.mkdir(parents=True, exist_ok=True)
    pool = -(-(sample.context_tokens + args.turns * (args.answer_tokens + 200)) // 4096) * 4096 + 4096
    with tempfile.TemporaryDirectory() as logs:  # the servers' logs (a failed start's error quotes tritonserver's)
        full = Loop(model_dir, "full", pool, Path(logs)).run(sample.context, keys, args.answer_tokens)
        other = Loop(model_dir, args.policy, pool, Path(logs)).run(sample.context, keys, args.answer_tokens,
                                                                    forced=full)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"  # the servers' (device auto)
    result = {"command": "bench/agent_loop.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                          if k != "out"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {device}", "commit": commit,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "document_tokens": sample.context_tokens,
              "policy": args.policy, "answer_tokens": args.answer_tokens,
              "turns": compare(full, other, values, tokenizer)}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "README.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
