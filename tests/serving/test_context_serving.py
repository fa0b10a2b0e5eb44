"""Reusable contexts through real servers sharing one real Redis store: a context is compressed once,
found by every replica, joined by concurrent requests, and refused clearly when it cannot be used.

One replica is started the way an operator starts it (``icekv serve --store redis://...``), the
other by the launcher, so the Redis store is imported by Triton's own Python stub.
"""

import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.serving.launcher import TritonServer, free_port, stop_process_group
from icekv.store import context_key
from tests.serving.conftest import metrics, post, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]
GEN = "/v2/models/icekv/generate"
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")
SETTINGS = {"pool_tokens": "8192", "max_active_requests": "8", "policy": "full"}
KV2 = "rho_scale=4"  # both replicas compress kv2 contexts with these settings, not the defaults


def _document(essays_text: str, key: str, number: int, start: int) -> str:
    words = essays_text.split()[start:start + 600]
    words.insert(300, f"One of the special magic numbers for {key} is: {number}.")
    return " ".join(words)


def _ask(replica, document: str, key: str, **fields):
    body = {"text_input": QUESTION.format(key=key), "max_tokens": 8, "context": document, "kv_budget": 0.25,
            **fields}
    status, out = post(replica, GEN, body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def cli_replica(smollm2_dir, redis_url, tmp_path_factory):
    """``icekv serve`` in its own process group, over the Redis store."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    log = tmp_path_factory.mktemp("icekv-serve") / "serve.log"
    command = [str(Path(sys.executable).with_name("icekv")), "serve", "--store", redis_url,
               "--pool-tokens", SETTINGS["pool_tokens"], "--policy", SETTINGS["policy"],
               "--max-active-requests", SETTINGS["max_active_requests"], "--kv2", KV2]
    command += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ))
    replica = SimpleNamespace(http_url=f"127.0.0.1:{ports['http']}", grpc_url=f"127.0.0.1:{ports['grpc']}",
                              metrics_url=f"http://127.0.0.1:{ports['metrics']}/metrics", process=process)
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, f"icekv serve exited with {process.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"icekv serve not ready:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://{replica.http_url}/v2/models/icekv/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    yield replica
    stop_process_group(process, 120)


@pytest.fixture(scope="module")
def launched_replica(smollm2_dir, redis_url):
    with TritonServer({**SETTINGS, "store": redis_url, "kv2": KV2}) as server:
        yield server


def test_a_context_compressed_on_one_replica_is_a_hit_on_the_other(cli_replica, launched_replica, essays_text,
                                                                     engine):
    document = _document(essays_text, "amber-falcon", 4817263, 0)
    before_a, before_b = metrics(cli_replica), metrics(launched_replica)
    first = _ask(cli_replica, document, "amber-falcon")
    second = _ask(launched_replica, document, "amber-falcon")
    assert first["context_cache"] == "compressed" and second["context_cache"] == "hit"
    assert first["context_key"] == second["context_key"] and len(first["context_key"]) == 64
    # compressed with the servers' kv2 settings: the key says so, and the answer is the engine's
    # over the same context compressed in-process with them (the CLI's path)
    ids = engine.tokenizer.encode(document)
    assert first["context_key"] == context_key(engine.model_id, ids, "kv2", 0.25, {"rho_scale": 4.0})
    assert first["context_key"] != context_key(engine.model_id, ids, "kv2", 0.25)
    local = engine.compress(ids, "kv2", 0.25, rho_scale=4.0)
    expected = engine.generate(QUESTION.format(key="amber-falcon"), SamplingConfig(max_tokens=8),
                               selection=SelectionConfig(policy="full"), context=local)
    assert first["text_output"] == expected.text
    assert second["text_output"] == first["text_output"]
    after_a, after_b = wait_idle(cli_replica), wait_idle(launched_replica)
    assert after_a["icekv_context_store_misses_total"] == before_a["icekv_context_store_misses_total"] + 1
    assert after_b["icekv_context_store_misses_total"] == before_b["icekv_context_store_misses_total"]
    assert after_b["icekv_context_store_hits_total"] == before_b["icekv_context_store_hits_total"] + 1
    assert after_a["icekv_context_compression_seconds_total"] > before_a["icekv_context_compression_seconds_total"]
    assert after_a["icekv_context_bytes_saved_total"] > before_a["icekv_context_bytes_saved_total"]
    assert after_b["icekv_contexts_in_memory"] >= 1 and after_b["icekv_context_bytes_in_memory"] > 0

    # the key alone now works on both, and answers the same
    by_key = {"text_input": QUESTION.format(key="amber-falcon"), "max_tokens": 8, "context_key": first["context_key"]}
    for replica in (cli_replica, launched_replica):
        status, out = post(replica, GEN, by_key)
        assert status == 200 and out["text_output"] == first["text_output"], out


def test_eight_concurrent_requests_on_a_new_context_compress_it_once(cli_replica, essays_text):
    document = _document(essays_text, "silver-heron", 5529107, 2000)
    before = metrics(cli_replica)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _ask(cli_replica, document, "silver-heron"), range(8)))
    after = wait_idle(cli_replica)
    assert after["icekv_context_store_misses_total"] == before["icekv_context_store_misses_total"] + 1
    joined = after["icekv_context_store_joined_total"] - before["icekv_context_store_joined_total"]
    hits = after["icekv_context_store_hits_total"] - before["icekv_context_store_hits_total"]
    assert joined + hits == 7 and joined >= 1  # they arrived while it ran; any later ones found it
    statuses = sorted(a["context_cache"] for a in answers)
    assert statuses.count("compressed") == 1 and statuses.count("joined") == joined
    assert len({a["context_key"] for a in answers}) == 1
    later = _ask(cli_replica, document, "silver-heron")
    assert later["context_cache"] == "hit"
    assert all(a["text_output"] == later["text_output"] for a in answers), [a["text_output"] for a in answers]
    assert after["icekv_kv_host_bytes"] == 0  # every request's pages are back


def test_a_new_context_sent_to_both_replicas_at_once_is_compressed_once(cli_replica, launched_replica, essays_text):
    """The replicas share one Redis: the first to claim the context compresses it, the other waits
    for its entry (or finds it) instead of compressing it again."""
    document = _document(essays_text, "copper-lynx", 6120384, 4000)
    replicas = (cli_replica, launched_replica)
    before = [metrics(r) for r in replicas]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _ask(replicas[i % 2], document, "copper-lynx"), range(4)))
    after = [wait_idle(r) for r in replicas]
    assert sum(a["icekv_context_store_misses_total"] - b["icekv_context_store_misses_total"]
               for a, b in zip(after, before)) == 1
    statuses = [a["context_cache"] for a in answers]
    assert statuses.count("compressed") == 1 and set(statuses) <= {"compressed", "joined", "hit"}, statuses
    assert len({a["text_output"] for a in answers}) == 1 and len({a["context_key"] for a in answers}) == 1


def test_compress_only_request_returns_the_key_and_sizes(launched_replica, cli_replica, essays_text):
    document = _document(essays_text, "quiet-lynx", 3094416, 4000)
    status, out = post(launched_replica, GEN, {"context": document, "kv_method": "snapkv", "kv_budget": 0.1})
    assert status == 200, out
    assert out["finish_reason"] == "context_ready" and out["context_cache"] == "compressed"
    assert out["text_output"] == "" and out["new_tokens"] == 0 and out["prompt_tokens"] > 500
    assert 0 < out["kv_resident_bytes"] < 0.2 * out["kv_total_bytes"]  # compressed vs full
    status, again = post(cli_replica, GEN, {"context": document, "kv_method": "snapkv", "kv_budget": 0.1})
    assert status == 200 and again["context_cache"] == "hit" and again["context_key"] == out["context_key"]
    # the same text under another method or budget is another context
    status, other = post(cli_replica, GEN, {"context": document, "kv_method": "snapkv", "kv_budget": 0.2})
    assert status == 200 and other["context_key"] != out["context_key"] and other["context_cache"] == "compressed"


def test_icekv_compress_through_the_server(cli_replica, essays_text, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text(_document(essays_text, "brave-otter", 7730152, 6000))
    icekv = str(Path(sys.executable).with_name("icekv"))
    run = lambda *extra: subprocess.run([icekv, "compress", "--context-file", str(document), "--server",
                                         cli_replica.grpc_url, *extra], capture_output=True, text=True, timeout=300)
    first = run("--json")
    assert first.returncode == 0, first.stderr
    report = __import__("json").loads(first.stdout)
    assert report["context_cache"] == "compressed" and report["bytes_after"] < report["bytes_before"]
    second = run()
    assert second.returncode == 0 and f"key: {report['key']}  (already compressed" in second.stdout
    bad = run("--kv2", "rho=0.5")
    assert bad.returncode != 0 and "--kv2 does not apply with --server" in bad.stderr
    unreachable = subprocess.run([icekv, "compress", "--context-file", str(document), "--server",
                                  f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert unreachable.returncode != 0 and "cannot reach an icekv server" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
