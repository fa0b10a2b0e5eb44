"""Soak of the prefix cache under pressure: conversations that must evict each other's pages.

``icekv serve`` with a page pool far smaller than the conversations (``--pool-tokens``), the prefix
cache spilling its pages to a store, and ``--clients`` threads holding chat conversations over the
OpenAI API: three documents, two conversations each (they share the document and diverge after
it), each turn sent with the whole conversation so far. Mixed in: streams cancelled after their
first event, ``n = 2`` and JSON mode. Two phases, each ``--minutes`` long:

- ``redis``: the store is a real redis-server, killed and started again halfway (a spill or a read
  meets an outage);
- ``disk``: the store is a directory whose entries are corrupted in place, over and over, while the
  server reads them.

Checked after each phase: no request hung; the server idle with no page held (by a request or a
leaked prefix-cache reference) and still answering; the prefix cache's counters add up (its hit
and miss tokens are every prompt token of every request that reached the engine, a chat prompt
counted as the server's template and tokenizer make it); and then, with the cache off
(``cache_prompt: false``), every greedy answer (and both choices of each ``n = 2``) is asked
again: none may differ. JSON-mode answers that finish must parse as objects.

    .venv/bin/python bench/prefix_soak.py [--minutes 5] [--clients 6] [--document-words 250] \
        [--pool-tokens 1024] [--out bench/results/prefix_soak]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from soak import TIMEOUT_S, metrics, post, start_redis  # bench/soak.py: the same server plumbing

from icekv.assets import Assets
from icekv.chat_template import ChatTemplate
from icekv.model import Tokenizer
from icekv.serving.launcher import free_port, stop_process_group

QUESTIONS = ("What is the text about?", "Name one person it mentions.", "Summarize it in one sentence.",
             "What is the special magic number?", "Which word appears most often?", "Give it a title.")
KINDS = ("turn", "cancelled", "two_choices", "json")
# zero once every request has ended: a page a leaked prefix-cache reference holds stays in use
IDLE_ZERO = ("icekv_active_requests", "icekv_queued_requests", "icekv_kv_host_bytes", "icekv_kv_pool_pages_in_use")


def chat(port: int, messages: list[dict], **extra) -> tuple[int, dict]:
    body = {"model": "icekv", "messages": messages, "max_tokens": 12, "temperature": 0, "policy": "full", **extra}
    status, raw = post(port, "/v1/chat/completions", json.dumps(body).encode())
    return status, json.loads(raw)


def cancelled_stream(port: int, messages: list[dict]) -> int:
    """A streamed turn the client drops after its first event; its HTTP status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    body = {"model": "icekv", "messages": messages, "max_tokens": 64, "temperature": 0, "policy": "full",
            "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body))
    resp = conn.getresponse()
    resp.fp.readline()
    conn.close()
    return resp.status


def conversations(seed: int, document_words: int) -> list[list[dict]]:
    """Three documents of ``document_words`` words, two conversations on each (same system prompt
    and document, then different questions)."""
    words = Assets().haystack_text("essays").split()
    rng = random.Random(seed)
    out = []
    for d in range(3):
        start = rng.randrange(len(words) - document_words)
        document = (" ".join(words[start: start + document_words])
                    + f" The special magic number is {rng.randrange(10**6)}.")
        for _ in range(2):
            out.append([{"role": "system", "content": "Answer briefly, from the document."},
                        {"role": "user", "content": f"Document {d}:\n{document}"},
                        {"role": "assistant", "content": "I have read it."}])
    return out


class Phase:
    """One phase's server, traffic and checks."""

    def __init__(self, name: str, args, model_dir: Path):
        self.name, self.args = name, args
        self.template, self.tokenizer = ChatTemplate.load(model_dir), Tokenizer(model_dir)
        self.work = Path(tempfile.mkdtemp(prefix=f"icekv-prefix-soak-{name}-"))
        self.http_port, self.grpc_port, self.metrics_port, self.redis_port = (free_port() for _ in range(4))
        self.records: list[dict] = []
        self.corrupted = 0  # store entries overwritten in place (disk phase)
        self.lock = threading.Lock()
        self.redis = start_redis(self.redis_port, str(self.work)) if name == "redis" else None
        store = f"redis://127.0.0.1:{self.redis_port}/0" if self.redis else str(self.work / "store")
        self.serve = subprocess.Popen(
            [str(Path(sys.executable).with_name("icekv")), "serve", "--store", store, "--prefix-cache-spill", "true",
             "--pool-tokens", str(args.pool_tokens), "--max-active-requests", str(args.clients),
             "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
             "--metrics-port", str(self.metrics_port)],
            stdout=open(self.work / "serve.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def prompt_tokens(self, messages: list[dict]) -> int:
        return len(self.tokenizer.encode(self.template.render(messages)))

    def wait_ready(self) -> None:
        while True:
            if self.serve.poll() is not None:
                raise SystemExit(f"icekv serve exited: {(self.work / 'serve.log').read_text()[-2000:]}")
            try:
                if chat(self.http_port, [{"role": "user", "content": "Hi"}], max_tokens=1)[0] == 200:
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(2)

    def settled_metrics(self) -> dict:
        """The metrics once the last request's counters have reached them (they are pushed on the
        engine's ticks): two reads a second apart that agree."""
        last = metrics(self.metrics_port)
        while True:
            time.sleep(1)
            now = metrics(self.metrics_port)
            if now == last:
                return now
            last = now

    def client(self, seed: int, convs: list[list[dict]], deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            c = rng.randrange(len(convs))
            kind = rng.choices(KINDS, weights=[6, 2, 1, 1])[0]
            with self.lock:
                messages = convs[c] + [{"role": "user", "content": rng.choice(QUESTIONS)}]
            record = {"kind": kind, "conversation": c, "messages": messages,
                      "engine_prompts": self.prompt_tokens(messages) * (2 if kind == "two_choices" else 1)}
            t0 = time.monotonic()
            try:
                if kind == "cancelled":
                    record["status"] = cancelled_stream(self.http_port, messages)
                else:
                    extra = {"n": 2} if kind == "two_choices" else {}
                    if kind == "json":
                        extra = {"response_format": {"type": "json_object"}, "max_tokens": 48}
                    record["status"], body = chat(self.http_port, messages, **extra)
                    record["answers"] = [ch["message"]["content"] for ch in body.get("choices", [])]
                    record["finished"] = [ch["finish_reason"] == "stop" for ch in body.get("choices", [])]
                    record["usage_prompt"] = body.get("usage", {}).get("prompt_tokens")
                    if kind == "turn" and record["status"] == 200:
                        with self.lock:  # the conversation goes on with this answer
                            convs[c] = messages + [{"role": "assistant", "content": record["answers"][0]}]
                            if len(convs[c]) > 11:  # keep prompts within the pool: start the talk again
                                convs[c] = convs[c][:3]
            except TimeoutError:
                record["status"] = "hung"
            except Exception as e:  # counted, never hidden
                record["status"] = f"{type(e).__name__}: {e}"[:160]
            record["s"] = round(time.monotonic() - t0, 2)
            with self.lock:
                self.records.append(record)

    def fault(self, deadline: float) -> None:
        """Halfway: Redis killed and back 5 s later; or, on disk, entries corrupted every second."""
        time.sleep((deadline - time.monotonic()) / 2)
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait()
            time.sleep(5)
            self.redis = start_redis(self.redis_port, str(self.work))
            return
        rng = random.Random(1)
        while time.monotonic() < deadline:
            files = [p for p in (self.work / "store").rglob("*") if p.is_file()]
            if files:
                path = rng.choice(files)
                try:
                    with open(path, "r+b") as f:  # in place, as a failing disk or a stray writer would
                        f.seek(rng.randrange(max(path.stat().st_size, 1)))
                        f.write(os.urandom(16))
                    self.corrupted += 1
                except OSError:  # evicted meanwhile
                    pass
            time.sleep(1)

    def run(self) -> dict:
        self.wait_ready()
        before = self.settled_metrics()
        convs = conversations(seed=7, document_words=self.args.document_words)
        deadline = time.monotonic() + self.args.minutes * 60
        threads = [threading.Thread(target=self.client, args=(i, convs, deadline)) for i in range(self.args.clients)]
        faults = threading.Thread(target=self.fault, args=(deadline,), daemon=True)
        for t in [*threads, faults]:
            t.start()
        for t in threads:
            t.join()
        idle = None
        for _ in range(60):
            m = metrics(self.metrics_port)
            if all(m[name] == 0 for name in IDLE_ZERO):
                idle = self.settled_metrics()
                break
            time.sleep(1)
        return self.check(before, idle)

    def check(self, before: dict, idle: dict | None) -> dict:
        reached = [r for r in self.records if r["status"] == 200]
        counted = (idle or {}).get("icekv_prefix_cache_hit_tokens_total", 0) \
            + (idle or {}).get("icekv_prefix_cache_miss_tokens_total", 0) \
            - before["icekv_prefix_cache_hit_tokens_total"] - before["icekv_prefix_cache_miss_tokens_total"]
        wrong, bad_json = [], 0
        for r in reached:  # the same question with the cache off: the same greedy answer
            if r["kind"] == "json" and r["finished"][0]:  # not one cut at max_tokens (JSON cut short)
                try:
                    bad_json += not isinstance(json.loads(r["answers"][0]), dict)
                except json.JSONDecodeError:
                    bad_json += 1
            elif r["kind"] in ("turn", "two_choices"):
                status, body = chat(self.http_port, r["messages"], cache_prompt=False)
                reference = body["choices"][0]["message"]["content"] if status == 200 else f"status {status}"
                wrong += [{"kind": r["kind"], "answers": r["answers"], "reference": reference}
                          for answer in r["answers"] if answer != reference]
        alive = self.serve.poll() is None and chat(self.http_port, [{"role": "user", "content": "Hi"}])[0] == 200
        stop_process_group(self.serve, 60)
        if self.redis is not None:
            self.redis.kill()
        statuses = Counter(str(r["status"]) for r in self.records)
        return {"requests": len(self.records), "by_kind": dict(Counter(r["kind"] for r in self.records)),
                "statuses": dict(statuses), "hung": statuses.get("hung", 0),
                "idle_after": idle is not None, "server_alive": alive,
                "prompt_tokens_sent": sum(r["engine_prompts"] for r in self.records if r["status"] == 200),
                "prompt_counts_unlike_the_server_s": sum(r.get("usage_prompt") not in (None, r["engine_prompts"])
                                                         for r in reached if r["kind"] in ("turn", "json")),
                "prefix_cache_hit_plus_miss_tokens": counted,
                "answers_compared": sum(len(r.get("answers", [])) for r in reached if r["kind"] != "json"),
                "answers_differing": len(wrong), "differing": wrong[:5], "json_not_an_object": bad_json,
                "json_finished": sum(r["finished"][0] for r in reached if r["kind"] == "json"),
                "entries_corrupted": self.corrupted,
                "metrics_after": {k: v for k, v in (idle or {}).items() if "prefix_cache" in k or "kv_" in k}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="per phase")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (and the server's running requests)")
    ap.add_argument("--document-words", type=int, default=250)
    ap.add_argument("--pool-tokens", type=int, default=1024, help="far below the six conversations' tokens")
    ap.add_argument("--phases", default="redis,disk")
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix_soak"))
    args = ap.parse_args()
    model_dir = Assets().model_dir("smollm2-135m")
    results = {name: Phase(name, args, model_dir).run() for name in args.phases.split(",")}
    result = {"command": " ".join(["bench/prefix_soak.py", *sys.argv[1:]]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "phases": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Prefix cache soak\n\n`{result['command']}` on {result['machine']}, commit {result['commit']}, "
             f"{result['date']}.\n", "| phase | requests | hung | statuses | idle, alive | prompt tokens sent / "
             "counted | answers differing / compared | JSON finished, not an object | entries corrupted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['requests']} | {r['hung']} | {r['statuses']} | {r['idle_after']}, "
                     f"{r['server_alive']} | {r['prompt_tokens_sent']} / {r['prefix_cache_hit_plus_miss_tokens']:g} | "
                     f"{r['answers_differing']} / {r['answers_compared']} | "
                     f"{r['json_finished']}, {r['json_not_an_object']} | "
                     f"{r['entries_corrupted']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = [name for name, r in results.items() if r["hung"] or r["answers_differing"] or r["json_not_an_object"]
              or not (r["idle_after"] and r["server_alive"])
              or r["prompt_tokens_sent"] != r["prefix_cache_hit_plus_miss_tokens"]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
