"""Soak: mixed traffic, hostile requests and a Redis restart against ``icekv serve`` on loopback.

Runs ``icekv serve --store redis://...`` (tritonserver + icekv's HTTP frontend) and a real
redis-server, then ``--clients`` threads send requests for ``--minutes`` (at most
``--max-requests``), each drawn from: a normal question (greedy; must answer " Paris"), a shared
context question, a stream the client abandons after its first event, an oversize body, malformed
JSON, 2,000 stop strings and an unknown context key. Halfway through, Redis is killed and started
again. At the end: no request hung (each has a client timeout), the engine is idle with its page
pool empty, the server still ready, every normal request answered correctly. Saves json + md under
bench/results/soak/.

    .venv/bin/python bench/soak.py [--minutes 15] [--clients 4] [--max-requests 2000]
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
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from icekv.assets import Assets
from icekv.serving.launcher import free_port, stop_process_group

TIMEOUT_S = 180  # a request without an answer by then counts as hung


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def abandon_stream(port: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    body = json.dumps({"text_input": "Tell me a long story about the sea. " * 20, "max_tokens": 200})
    conn.request("POST", "/v2/models/icekv/generate_stream", body=body)
    resp = conn.getresponse()
    first = resp.fp.readline()
    conn.close()  # the client goes away mid-stream
    return resp.status, first


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("icekv_")}


def start_redis(port: int, directory: str) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    args = ap.parse_args()
    words = Assets().haystack_text("essays").split()
    document = " ".join(words[:500] + ["One of the special magic numbers for quiet-heron is: 5150712."] + words[500:900])
    work = tempfile.mkdtemp(prefix="icekv-soak-")
    redis_port, http_port, grpc_port, metrics_port = (free_port() for _ in range(4))
    redis = start_redis(redis_port, work)
    serve = subprocess.Popen([str(Path(sys.executable).with_name("icekv")), "serve", "--store",
                              f"redis://127.0.0.1:{redis_port}/0", "--http-port", str(http_port), "--grpc-port",
                              str(grpc_port), "--metrics-port", str(metrics_port), "--pool-tokens", "16384"],
                             stdout=open(Path(work) / "serve.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    while True:
        if serve.poll() is not None:
            raise SystemExit(f"icekv serve exited: {(Path(work) / 'serve.log').read_text()[-2000:]}")
        try:
            if post(http_port, "/v2/models/icekv/generate", b'{"text_input": "Hi", "max_tokens": 1}')[0] == 200:
                break
        except OSError:  # not listening yet
            pass
        time.sleep(2)

    kinds = {
        "normal": lambda: post(http_port, "/v2/models/icekv/generate",
                               json.dumps({"text_input": "The capital of France is", "max_tokens": 4,
                                           "policy": "full"}).encode()),
        "context": lambda: post(http_port, "/v2/models/icekv/generate", json.dumps({
            "context": document, "kv_method": "snapkv", "kv_budget": 0.5, "max_tokens": 8,
            "text_input": "\nThe special magic number for quiet-heron mentioned in the provided text is"}).encode()),
        "abandoned_stream": lambda: abandon_stream(http_port),
        "oversize": lambda: post(http_port, "/v2/models/icekv/generate",
                                 json.dumps({"text_input": "word " * 1_000_000}).encode()),
        "malformed": lambda: post(http_port, "/v2/models/icekv/generate", b'{"text_input": "hi", '),
        "long_stop_list": lambda: post(http_port, "/v2/models/icekv/generate",
                                       json.dumps({"text_input": "hi", "stop": ["x"] * 2000}).encode()),
        "unknown_key": lambda: post(http_port, "/v2/models/icekv/generate",
                                    json.dumps({"text_input": "hi", "context_key": "ab" * 32}).encode()),
    }
    expected = {"normal": 200, "context": 200, "abandoned_stream": 200, "oversize": 413, "malformed": 400,
                "long_stop_list": 400, "unknown_key": 400}
    records, lock = [], threading.Lock()
    deadline = time.monotonic() + args.minutes * 60
    budget = iter(range(args.max_requests))

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            with lock:
                if next(budget, None) is None:
                    return
            kind = rng.choices(list(kinds), weights=[5, 2, 2, 1, 1, 1, 1])[0]
            t0 = time.monotonic()
            try:
                status, body = kinds[kind]()
                outcome = "ok" if status == expected[kind] else f"status {status}"
                if kind == "unknown_key" and status == 503 and redis_down(t0):
                    outcome = "ok"  # the store was unreachable: busy, not "unknown"
                if kind == "normal" and status == 200 and "Paris" not in json.loads(body)["text_output"]:
                    outcome = "wrong answer"
            except TimeoutError:
                outcome = "hung"
            except urllib.error.URLError as e:
                refused = kind == "oversize" and isinstance(e.reason, (BrokenPipeError, ConnectionResetError))
                outcome = "ok" if refused else f"URLError: {e.reason}"[:120]  # oversize: closed while sending
            except Exception as e:  # counted, never hidden
                outcome = f"{type(e).__name__}: {e}"[:120]
            with lock:
                records.append({"kind": kind, "outcome": outcome, "s": round(time.monotonic() - t0, 3)})

    down: list[float] = []  # when Redis was killed, and when it was back

    def redis_down(t: float) -> bool:
        return bool(down) and down[0] - 1 <= t <= (down[1] + 2 if len(down) > 1 else float("inf"))

    def restart_redis() -> None:
        nonlocal redis
        time.sleep(args.minutes * 30)
        down.append(time.monotonic())
        redis.kill()
        redis.wait()
        time.sleep(5)  # requests meanwhile: a context request compresses anyway, a key-only one gets 503
        redis = start_redis(redis_port, work)
        down.append(time.monotonic())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=restart_redis, daemon=True))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    wall = time.monotonic() - t0
    idle = None
    for _ in range(60):
        m = metrics(metrics_port)
        if m["icekv_active_requests"] == 0 and m["icekv_queued_requests"] == 0 and m["icekv_kv_host_bytes"] == 0:
            idle = m
            break
        time.sleep(1)
    ready = post(http_port, "/v2/models/icekv/generate", b'{"text_input": "The capital of France is", '
                 b'"max_tokens": 4, "policy": "full"}')
    alive = serve.poll() is None
    stop_process_group(serve, 60)
    redis.kill()
    outcomes = Counter((r["kind"], r["outcome"]) for r in records)
    result = {
        "command": "bench/soak.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                               if k != "out"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "wall_s": round(wall, 1), "requests": len(records),
        "hung": sum(r["outcome"] == "hung" for r in records),
        "not_as_expected": [f"{k}: {o} x{n}" for (k, o), n in sorted(outcomes.items()) if o != "ok"],
        "by_kind": {k: sum(n for (kind, _), n in outcomes.items() if kind == k) for k in kinds},
        "idle_after": idle is not None, "pages_leaked_bytes": None if idle is None else idle["icekv_kv_host_bytes"],
        "server_alive": alive, "answers_after": ready[0] == 200 and b"Paris" in ready[1],
        "metrics_after": idle,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    md = ["# Soak: mixed and hostile traffic with a Redis restart", "",
          f"`{result['command']}` on {result['machine']}, commit {result['commit']}, {result['date']}.", "",
          "| wall s | requests | hung | not as expected | idle after (no pages held) | server alive and answering |",
          "|---|---|---|---|---|---|",
          f"| {result['wall_s']} | {result['requests']} | {result['hung']} | "
          f"{len(result['not_as_expected'])} kinds | {result['idle_after']} | "
          f"{result['server_alive'] and result['answers_after']} |", "",
          "Requests by kind: " + ", ".join(f"{k} {n}" for k, n in result["by_kind"].items()) + ".", ""]
    md += [f"- {line}" for line in result["not_as_expected"]] or ["Every request got the expected status "
                                                                  "(and every normal one the right answer)."]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
