"""Replicas behind the SGLang Model Gateway: does cache-aware routing keep a conversation where its
prefix is, and does a conversation survive its replica dying mid-turn?

Two icekv replicas (``Replica``: tritonserver + OpenAI frontend each) over one real
redis-server with ``prefix_cache_spill`` (so each can read the other's prefix pages), behind the
gateway (``RouterProcess``). With ``--store none`` they share nothing: a turn finds only what its
replica cached itself, which is what routing alone keeps (with ``--pool-tokens`` too small for
every conversation, what a replica can hold). Clients send plain OpenAI chat bodies (greedy, streamed, usage asked
with ``stream_options``) to the gateway, never to a replica.

1. Routing, run twice in one invocation: ``cache_aware``, then ``round_robin`` (``--baseline``),
   each on fresh replicas and a fresh redis-server, if any (neither starts warm).
   ``--conversations`` concurrent conversations of ``--turns`` turns, each over its own
   ``--doc-tokens`` document (the essays haystack with keyed needles, ``make_reusable`` with seed
   ``--seed + c``; turn k asks for the k-th needle and every turn resends the whole
   conversation). Measured over turns 2..T: the prefix-cache hit rate (sum of
   ``usage.prompt_tokens_details.cached_tokens`` / sum of ``prompt_tokens``), time to the first
   streamed content (median and p90), and how many turns landed on the replica that served the
   conversation's previous turn. Round robin alternates over all requests, not per
   conversation: conversations that keep in step with an even number of them send an even
   number of requests between one conversation's turns, which brings each turn back to its
   previous replica by arithmetic. The landings measured say how often that happened;
   ``--baseline random`` is the comparison free of it.
2. Failover, on a third fresh set (``cache_aware``): one conversation, a few turns, then a
   streamed turn (a long answer asked) during which the replica serving it is SIGKILLed
   (``os.killpg`` on its tritonserver's and its frontend's process groups) as soon as the client
   has its first content; recorded: how the client's stream ended and how long after the kill.
   Then the client resends that turn (as a retrying client would; attempts bounded): which
   replica served it, its cached tokens, the tokens recomputed (``prompt_tokens - cached_tokens``)
   against the turn's new tokens (its prompt minus the previous turn's prompt and answer).

How a turn's replica is known (landing). Per-replica counters cannot say it under concurrency:
``icekv_requests_completed_total`` and ``icekv_prefix_cache_reloaded_pages_total`` move for
several conversations' turns within one turn's time, and a turn that lands on the other replica
reloads a varying number of pages (none it already holds from an earlier visit, none the store
has not been written yet), so neither attributes a request. Instead each replica is registered with
the gateway behind a TCP pass-through of this script's own (``Tap``: bytes forwarded unchanged both
ways, no buffering of the response stream). The tap reads the HTTP requests going to its replica
and notes each chat completion's conversation (the hash of its first user message, which holds the
document) and turn (its number of user messages). So every request is attributed exactly, whatever
runs beside it; a turn the gateway retried on the other replica shows twice and counts where its
last copy went (retries are reported). Cross-checks in the results: per replica, the chat
requests its tap carried against its ``icekv_requests_completed_total`` delta, and its reloaded
pages. When the replica is killed, its tap stops accepting (its listener is shut down: the
gateway's next connection is refused, as the dead replica's port would refuse it), and a
connection whose replica side ends (closed, reset) is shut down towards the gateway at once, as
the gateway would see the dead process's socket close. The taps cost a loopback hop per request
in both routing runs alike.

    .venv/bin/python bench/replicas_routing.py [--model smollm2-135m] [--turns 10] [--conversations 8]
        [--doc-tokens 3000] [--max-tokens 16] [--out bench/results/replicas_routing.json]
    .venv/bin/python bench/replicas_routing.py --store none --pool-tokens 16384 --skip failover \
        --out bench/results/replicas_routing_no_store.json
    .venv/bin/python bench/replicas_routing.py --quick --out /tmp/replicas_quick.json   # a smoke

Saves the json at ``--out`` (with the command line) and a table beside it (same stem, ``.md``).
The target figures (hit rate >= 0.9 under cache_aware; turns 2..T's TTFT <= 0.5x round robin's;
no turn lost; tokens recomputed <= the turn's new tokens) are reported next to what was measured.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from serving_load import percentile  # bench/serving_load.py
from soak import start_redis  # bench/soak.py
from http_tap import Tap, first_user_key  # bench/http_tap.py

from icekv.assets import Assets
from icekv.eval.tasks import HaystackSampler, make_reusable
from icekv.model import Tokenizer
from icekv.registry import DEFAULT_MODEL
from icekv.serving.replicas import Replica, RouterProcess

TICK_S = 0.5  # polling step of the metric reads (icekv pushes its counters on a tick)
FAILOVER_QUESTION = "Retell the whole document in your own words, paragraph by paragraph, in detail."


# ------------------------------------------------------------------------------- client and metrics

def chat(url: str, messages: list, max_tokens: int, timeout_s: float, on_first_content=None) -> dict:
    """One streamed chat turn through ``url``: its answer, time to the first content, usage, and how
    it ended. ``on_first_content()`` is called once, right after the first content arrives. Raises
    on an HTTP error status or an error before any content; a stream that breaks later is
    returned with ``ended`` saying how."""
    parts = urlsplit(url)
    body = {"model": "icekv", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    out = {"answer": "", "ttft_s": None, "prompt_tokens": None, "cached_tokens": None, "completion_tokens": None,
           "finish_reason": None, "ended": None, "pieces": 0}
    first_at = None
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        pieces = []
        while True:
            if time.monotonic() > deadline:
                out["ended"] = f"client timeout ({timeout_s:g} s)"
                break
            try:
                line = response.readline()
            except (http.client.HTTPException, OSError) as e:
                if first_at is None:
                    raise
                out["ended"] = f"connection error: {type(e).__name__}: {e}"[:200]
                break
            if not line:
                out["ended"] = "connection closed without [DONE]"
                break
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out["ended"] = "[DONE]"
                break
            event = json.loads(data)
            if "error" in event and not event.get("choices"):
                if first_at is None:
                    raise RuntimeError(f"error event: {json.dumps(event)[:300]}")
                out["ended"] = f"error event: {json.dumps(event['error'])[:200]}"
                out["error_event"] = event["error"]
                continue  # the server sends [DONE] after it; read on
            if event.get("usage"):
                u = event["usage"]
                out["prompt_tokens"], out["completion_tokens"] = u.get("prompt_tokens"), u.get("completion_tokens")
                out["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    pieces.append(text)
                    out["pieces"] += 1
                    if first_at is None:
                        first_at = time.perf_counter()
                        out["ttft_s"] = first_at - t0
                        if on_first_content is not None:
                            on_first_content()
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
        out["answer"] = "".join(pieces)
    finally:
        connection.close()
    out["total_s"] = time.perf_counter() - t0
    if out["ttft_s"] is None and out["ended"] == "[DONE]":  # an empty answer: the end is its first token
        out["ttft_s"] = out["total_s"]
    return out


def metrics(replica: Replica) -> dict[str, float]:
    """The replica's icekv_* samples, summed over labels."""
    out: dict[str, float] = {}
    text = urllib.request.urlopen(replica.server.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("icekv_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def settled(replicas: list[Replica], timeout_s: float = 60.0) -> list[dict[str, float]]:
    """Each replica's metrics once none has a request active or queued and two reads a few ticks
    apart agree (the last requests' counters are pushed on a tick); the last read at the timeout."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        now = [metrics(r) for r in replicas]
        idle = all(m.get("icekv_active_requests", 0) == 0 and m.get("icekv_queued_requests", 0) == 0 for m in now)
        if (idle and now == previous) or time.monotonic() > deadline:
            return now
        previous = now if idle else None
        time.sleep(3 * TICK_S)


def delta(before: list[dict], after: list[dict], name: str) -> list[float]:
    return [a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after)]


# ------------------------------------------------------------------------------------- one fleet

class Fleet:
    """A fresh redis-server (unless ``--store none``), two replicas over it (each behind a tap) and
    the gateway over the taps."""

    def __init__(self, name: str, policy: str, args, work: Path, keys: dict[str, int]):
        self.name, self.policy, self.args, self.keys = name, policy, args, keys
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.redis = None
        self.replicas: list[Replica] = []
        self.taps: list[Tap] = []
        self.router: RouterProcess | None = None

    def start(self) -> "Fleet":
        params = {"model_dir": self.args.model_dir}
        if self.args.store == "redis":
            params.update(store=f"redis://127.0.0.1:{self.start_redis()}/0", prefix_cache_spill="true")
        for name in ("policy", "pool_tokens", "num_threads"):
            if getattr(self.args, name) is not None:
                params[name] = str(getattr(self.args, name))
        self.params = params
        for i in range(2):
            replica = Replica(params, self.args.timeout, None, self.dir, i)
            self.replicas.append(replica)
            print(f"[{self.name}] starting replica {i}", flush=True)
            replica.start()
        for replica in self.replicas:  # first-request costs, off the measured turns (and off the gateway)
            chat(replica.url, [{"role": "user", "content": "Hello"}], 2, self.args.timeout)
        self.taps = [Tap(r.url, i, self.events, self.lock).start() for i, r in enumerate(self.replicas)]
        self.router = RouterProcess(tuple(t.url for t in self.taps), self.policy,
                                    log_path=self.dir / "router.log").start()
        return self

    def start_redis(self) -> int:
        """A fresh redis-server on a free loopback port: the port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.redis = start_redis(port, str(self.dir))
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return port
            except OSError:
                if time.monotonic() > deadline or self.redis.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.router is not None:
            try:
                self.router.stop()
            except Exception as e:  # noqa: BLE001 - the rest must still stop
                print(f"[{self.name}] stopping the router: {e}", file=sys.stderr)
        for tap in self.taps:
            tap.stop()
        for replica in self.replicas:
            try:
                replica.stop()
            except Exception as e:  # noqa: BLE001
                print(f"[{self.name}] stopping a replica: {e}", file=sys.stderr)
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(10)

    def landings(self, since: float = 0.0) -> dict[tuple[int, int], list[int]]:
        """(conversation, turn) -> the replicas its requests (sent at ``since`` or later) went to, in order."""
        out: dict[tuple[int, int], list[int]] = {}
        with self.lock:
            for e in sorted(self.events, key=lambda e: e["t"]):
                if e["key"] in self.keys and e["t"] >= since:
                    out.setdefault((self.keys[e["key"]], e["turn"]), []).append(e["replica"])
        return out

    def chat_requests_per_replica(self) -> list[int]:
        with self.lock:
            return [sum(1 for e in self.events if e["replica"] == i and e["key"] in self.keys)
                    for i in range(len(self.replicas))]


# ------------------------------------------------------------------------------------- routing

def routing_run(policy: str, args, work: Path, samples: list, keys: dict[str, int]) -> dict:
    fleet = Fleet(f"routing-{policy}", policy, args, work, keys)
    records: list[dict] = []
    lock = threading.Lock()
    try:
        fleet.start()
        before = settled(fleet.replicas)
        barrier = threading.Barrier(len(samples))

        def conversation(c: int) -> None:
            sample, messages = samples[c], []
            barrier.wait(timeout=60)
            for t in range(args.turns):
                question = sample.questions[t % len(sample.questions)][0].strip()
                messages.append({"role": "user", "content": (sample.context + "\n\n" if t == 0 else "") + question})
                try:
                    r = chat(fleet.router.url, messages, args.max_tokens, args.timeout)
                    if r["ended"] != "[DONE]":
                        raise RuntimeError(f"stream ended: {r['ended']}")
                except Exception as e:  # counted and reported, never hidden; the conversation stops
                    with lock:
                        records.append({"conversation": c, "turn": t + 1, "error": f"{type(e).__name__}: {e}"[:300]})
                    return
                r.update(conversation=c, turn=t + 1)
                with lock:
                    records.append(r)
                messages.append({"role": "assistant", "content": r["answer"]})
                print(f"[{policy}] conversation {c} turn {t + 1}: ttft {r['ttft_s']:.2f} s, "
                      f"{r['cached_tokens']}/{r['prompt_tokens']} cached", flush=True)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(len(samples))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = settled(fleet.replicas)
        landings = fleet.landings()
        tapped = fleet.chat_requests_per_replica()
    finally:
        fleet.stop()
    ok = [r for r in records if "error" not in r]
    for r in ok:
        r["replica"] = landings.get((r["conversation"], r["turn"]), [None])[-1]
        r["sent_to"] = landings.get((r["conversation"], r["turn"]), [])
    served = {(r["conversation"], r["turn"]): r["replica"] for r in ok}
    later = [r for r in ok if r["turn"] >= 2]
    known = [r for r in later
             if r["replica"] is not None and served.get((r["conversation"], r["turn"] - 1)) is not None]
    stayed = [r for r in known if r["replica"] == served[(r["conversation"], r["turn"] - 1)]]
    ttft = [r["ttft_s"] for r in later if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] or 0 for r in later)
    cached = sum(r["cached_tokens"] or 0 for r in later)
    first = [r["ttft_s"] for r in ok if r["turn"] == 1 and r["ttft_s"] is not None]
    return {
        "policy": policy, "wall_s": wall, "turns_sent": len(records), "turns_answered": len(ok),
        "errors": [r for r in records if "error" in r],
        "later_turns": len(later), "usage_missing": sum(r["prompt_tokens"] is None for r in later),
        "hit_rate_later_turns": cached / prompt if prompt else None,
        "cached_tokens_later_turns": cached, "prompt_tokens_later_turns": prompt,
        "ttft_later_median_s": statistics.median(ttft) if ttft else None,
        "ttft_later_p90_s": percentile(ttft, 0.9) if ttft else None,
        "ttft_first_turn_median_s": statistics.median(first) if first else None,
        "stayed_on_previous_replica": len(stayed), "landings_known": len(known),
        "turns_sent_twice_by_the_gateway": sum(len(v) > 1 for v in landings.values()),
        "per_replica": {
            "chat_requests_tapped": tapped,
            "requests_completed_delta": delta(before, after, "icekv_requests_completed_total"),
            "reloaded_pages_delta": delta(before, after, "icekv_prefix_cache_reloaded_pages_total"),
            "hit_tokens_delta": delta(before, after, "icekv_prefix_cache_hit_tokens_total"),
            "miss_tokens_delta": delta(before, after, "icekv_prefix_cache_miss_tokens_total"),
            "turns_served": [sum(1 for r in ok if r["replica"] == i) for i in range(2)],
        },
        "records": records,
    }


# ------------------------------------------------------------------------------------- failover

def failover_run(args, work: Path, sample, keys: dict[str, int], c: int) -> dict:
    fleet = Fleet("failover", "cache_aware", args, work, keys)
    turns, messages = [], []
    before_turns = max(1, min(3, args.turns - 1))
    killed_turn = before_turns + 1
    out: dict = {"turns_before_kill": before_turns, "killed_turn": killed_turn, "question": FAILOVER_QUESTION,
                 "max_tokens": args.failover_max_tokens}
    try:
        fleet.start()
        for t in range(before_turns):
            question = sample.questions[t % len(sample.questions)][0].strip()
            messages.append({"role": "user", "content": (sample.context + "\n\n" if t == 0 else "") + question})
            r = chat(fleet.router.url, messages, args.max_tokens, args.timeout)
            if r["ended"] != "[DONE]":
                raise RuntimeError(f"turn {t + 1} before the kill ended: {r['ended']}")
            r.update(turn=t + 1, replica=fleet.landings().get((c, t + 1), [None])[-1])
            turns.append(r)
            messages.append({"role": "assistant", "content": r["answer"]})
            print(f"[failover] turn {t + 1} on replica {r['replica']}: {r['cached_tokens']}/{r['prompt_tokens']} "
                  "cached", flush=True)
        previous = turns[-1]
        messages.append({"role": "user", "content": FAILOVER_QUESTION})
        before = settled(fleet.replicas)
        kill: dict = {}

        def kill_its_replica() -> None:
            sent = fleet.landings(since=stream_started).get((c, killed_turn), [])
            victim = sent[-1] if sent else previous["replica"]
            replica = fleet.replicas[victim]
            fleet.taps[victim].stop_accepting()
            for process in (replica.server.process, replica.frontend.process):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kill.update(replica=victim, at=time.monotonic(), in_flight_on=sent,
                        killed_served_previous_turn=victim == previous["replica"])

        stream_started = time.monotonic()
        streamed = chat(fleet.router.url, messages, args.failover_max_tokens,
                        min(args.timeout, args.failover_timeout), on_first_content=kill_its_replica)
        ended_at = time.monotonic()
        out["in_flight"] = {
            "ended": streamed["ended"], "finish_reason": streamed["finish_reason"],
            "pieces_received": streamed["pieces"], "completion_tokens": streamed["completion_tokens"],
            "seconds_from_kill_to_end": ended_at - kill["at"] if kill else None,
            "ttft_s": streamed["ttft_s"], "killed_replica": kill.get("replica"),
            "sent_to": kill.get("in_flight_on"), "killed_served_previous_turn": kill.get("killed_served_previous_turn"),
            "answer_received": streamed["answer"][:500],
        }
        print(f"[failover] killed replica {kill.get('replica')} mid-stream; the client got: {streamed['ended']} "
              f"after {out['in_flight']['seconds_from_kill_to_end']}", flush=True)
        if not kill:
            raise RuntimeError("the streamed turn gave no content: nothing was killed")
        survivor = 1 - kill["replica"]
        attempts, resent, resend_started = [], None, time.monotonic()
        deadline = resend_started + args.failover_timeout
        while resent is None and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                r = chat(fleet.router.url, messages, args.failover_max_tokens, args.timeout)
                if r["ended"] != "[DONE]":
                    raise RuntimeError(f"stream ended: {r['ended']}")
                resent = r
                attempts.append({"after_s": t0 - resend_started, "ok": True})
            except Exception as e:  # noqa: BLE001 - each failed attempt is reported
                attempts.append({"after_s": t0 - resend_started, "ok": False,
                                 "error": f"{type(e).__name__}: {e}"[:300]})
                time.sleep(1.0)
        after = settled([fleet.replicas[survivor]])
        sent = fleet.landings(since=resend_started).get((c, killed_turn), [])
        out["resend"] = {"attempts": attempts}
        if resent is not None:
            new_tokens = resent["prompt_tokens"] - previous["prompt_tokens"] - previous["completion_tokens"]
            out["resend"].update(
                served_by=sent[-1] if sent else None, sent_to=sent, survivor=survivor,
                prompt_tokens=resent["prompt_tokens"], cached_tokens=resent["cached_tokens"],
                tokens_recomputed=resent["prompt_tokens"] - resent["cached_tokens"],
                turn_new_tokens=new_tokens, ttft_s=resent["ttft_s"], total_s=resent["total_s"],
                completion_tokens=resent["completion_tokens"], finish_reason=resent["finish_reason"],
                survivor_reloaded_pages=after[0].get("icekv_prefix_cache_reloaded_pages_total", 0.0)
                - before[survivor].get("icekv_prefix_cache_reloaded_pages_total", 0.0),
                survivor_requests_completed=after[0].get("icekv_requests_completed_total", 0.0)
                - before[survivor].get("icekv_requests_completed_total", 0.0))
        out["turns_lost"] = 0 if resent is not None else 1
    finally:
        fleet.stop()
    out["turns"] = turns
    out["previous_turn"] = {k: turns[-1][k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens",
                                                      "replica")} if turns else None
    return out


# ------------------------------------------------------------------------------------- report

def fmt(x, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    ca, rr = result["routing"]["cache_aware"], result["routing"][result["settings"].get("baseline", "round_robin")]
    s = result["settings"]
    lines = ["# Replicas behind the SGLang Model Gateway: routing and failover", "",
             f"`{result['command']}` on {result['machine']}, commit {result['commit']}, {result['date']}.", "",
             f"Two replicas ({s['model']}, engine policy {s['policy'] or 'default'}, "
             + (f"{s['pool_tokens']}-token pools" if s["pool_tokens"] else "the server's default pools") + ") "
             + ("over one redis-server with prefix_cache_spill" if s.get("store", "redis") == "redis"
                else "with no shared store (each replica's own prefix cache only)")
             + f"; {s['conversations']} concurrent conversations x {s['turns']} turns over "
             f"{result['document_tokens_mean']:.0f}-token documents (one each), at most {s['max_tokens']} new tokens "
             "per answer, greedy, streamed. Turns 2.. only:", "",
             "| router | hit rate | TTFT median s | TTFT p90 s | stayed on previous replica | turn-1 TTFT median s "
             "| answered / sent | gateway retries | reloaded pages per replica |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in (ca, rr):
        lines.append(f"| {run['policy']} | {fmt(run['hit_rate_later_turns'])} | {fmt(run['ttft_later_median_s'])} | "
                     f"{fmt(run['ttft_later_p90_s'])} | {run['stayed_on_previous_replica']}/{run['landings_known']} | "
                     f"{fmt(run['ttft_first_turn_median_s'])} | {run['turns_answered']}/{run['turns_sent']} | "
                     f"{run['turns_sent_twice_by_the_gateway']} | "
                     f"{' / '.join(f'{x:.0f}' for x in run['per_replica']['reloaded_pages_delta'])} |")
    t = result["targets"]
    lines += ["", f"TTFT ratio cache_aware / {rr['policy']}: median {fmt(t['ttft_ratio_median'])}, "
              f"p90 {fmt(t['ttft_ratio_p90'])} (target <= 0.5: {t['ttft_ratio_median_met']}); hit rate under "
              f"cache_aware {fmt(t['hit_rate_cache_aware'])} (target >= 0.9: {t['hit_rate_met']}).", ""]
    f = result.get("failover")
    if f and "error" in f:
        lines += ["## Failover", "", f"Did not complete: {f['error']}"]
    elif f:
        i, r = f.get("in_flight", {}), f.get("resend", {})
        lines += ["## Failover", "",
                  f"{f['turns_before_kill']} turn(s), then turn {f['killed_turn']} (streamed, at most "
                  f"{f['max_tokens']} tokens): replica {i.get('killed_replica')} killed after the first content "
                  f"(it served the previous turn: {i.get('killed_served_previous_turn')}). The client got: "
                  f"{i.get('ended')}, {fmt(i.get('seconds_from_kill_to_end'), '.2f')} s after the kill, "
                  f"{i.get('pieces_received')} pieces.", "",
                  f"Resent: {len(r.get('attempts', []))} attempt(s); served by replica {r.get('served_by')} "
                  f"(sent to {r.get('sent_to')}); {r.get('cached_tokens')}/{r.get('prompt_tokens')} tokens cached, "
                  f"{r.get('tokens_recomputed')} recomputed against {r.get('turn_new_tokens')} new tokens in the turn "
                  f"(target: <= them: {t.get('recomputed_met')}); turns lost {f.get('turns_lost')}; the survivor read "
                  f"{fmt(r.get('survivor_reloaded_pages'), '.0f')} pages from the store."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a known model name")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=16, help="per answer")
    ap.add_argument("--failover-max-tokens", type=int, default=128, help="the killed (and resent) turn's answer")
    ap.add_argument("--policy", default=None, help="the replicas' engine policy (default: the server's)")
    ap.add_argument("--pool-tokens", type=int, default=None, help="per replica (default: the server's)")
    ap.add_argument("--num-threads", type=int, default=None, help="per replica's forward pass (default: torch's)")
    ap.add_argument("--seed", type=int, default=0, help="conversation c's document: make_reusable seed + c")
    ap.add_argument("--timeout", type=float, default=900.0, help="the longest one request (or its next piece) may take")
    ap.add_argument("--failover-timeout", type=float, default=120.0, help="the longest the resend may keep trying")
    ap.add_argument("--baseline", choices=("round_robin", "random", "power_of_two"), default="round_robin",
                    help="the policy cache_aware is compared with")
    ap.add_argument("--store", choices=("redis", "none"), default="redis",
                    help="the replicas' shared prefix store: a fresh redis-server with prefix_cache_spill, or none "
                         "(a turn on the other replica finds only what that replica cached itself)")
    ap.add_argument("--skip", choices=("routing", "failover"), default=None, help="leave one part out")
    ap.add_argument("--quick", action="store_true", help="a smoke: 2 conversations, 2 turns, ~300-token documents")
    ap.add_argument("--out", type=Path, default=Path("bench/results/replicas_routing.json"))
    args = ap.parse_args()
    if args.store == "none" and args.skip != "failover":
        ap.error("--store none measures routing alone: add --skip failover (failover reads the store)")
    if args.quick:
        args.conversations, args.turns, args.doc_tokens = 2, 2, 300
        args.failover_max_tokens = min(args.failover_max_tokens, 64)
    assets = Assets()
    model_dir = assets.model_dir(args.model)
    args.model_dir = str(model_dir)
    sampler = HaystackSampler(assets.haystack_text("essays"), Tokenizer(model_dir))
    samples = [make_reusable(sampler, args.doc_tokens, args.seed + c, args.turns)
               for c in range(args.conversations + 1)]  # the last one: the failover's
    if len({s.context for s in samples}) != len(samples):
        raise SystemExit("two conversations got the same document: choose another --seed")
    keys = {first_user_key([{"role": "user", "content": s.context + "\n\n" + s.questions[0][0].strip()}]): c
            for c, s in enumerate(samples)}
    work = Path(tempfile.mkdtemp(prefix="icekv-replicas-routing-"))
    print(f"logs under {work}", flush=True)
    result: dict = {"routing": {}, "failover": None}
    if args.skip != "routing":
        for policy in ("cache_aware", args.baseline):
            result["routing"][policy] = routing_run(policy, args, work, samples[:-1], keys)
    if args.skip != "failover":
        try:
            result["failover"] = failover_run(args, work, samples[-1], keys, len(samples) - 1)
        except Exception as e:  # reported, the routing figures still saved
            result["failover"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    ca, rr = result["routing"].get("cache_aware", {}), result["routing"].get(args.baseline, {})

    def ratio(key: str):
        a, b = ca.get(key), rr.get(key)
        return a / b if a is not None and b else None

    f = result["failover"] or {}
    resend = f.get("resend", {})
    result["targets"] = {
        "baseline": args.baseline, "hit_rate_cache_aware": ca.get("hit_rate_later_turns"),
        "hit_rate_met": None if ca.get("hit_rate_later_turns") is None else ca["hit_rate_later_turns"] >= 0.9,
        "ttft_ratio_median": ratio("ttft_later_median_s"), "ttft_ratio_p90": ratio("ttft_later_p90_s"),
        "ttft_ratio_median_met": None if ratio("ttft_later_median_s") is None else ratio("ttft_later_median_s") <= 0.5,
        "turns_lost": f.get("turns_lost"),
        "tokens_recomputed": resend.get("tokens_recomputed"), "turn_new_tokens": resend.get("turn_new_tokens"),
        "recomputed_met": None if resend.get("tokens_recomputed") is None
        else resend["tokens_recomputed"] <= resend["turn_new_tokens"],
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    try:
        import torch
        device = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "CPU only"
    except Exception:  # noqa: BLE001
        device = "device unknown"
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "model_dir")}
    result = {"command": shlex.join(["bench/replicas_routing.py", *sys.argv[1:]]), "settings": settings,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {device}", "commit": commit,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "document_tokens": [s.context_tokens for s in samples],
              "document_tokens_mean": statistics.mean(s.context_tokens for s in samples), "logs": str(work),
              **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    md = markdown(result) if ca and rr else json.dumps(result["targets"], indent=1)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    print(f"saved {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
