"""Schema-driven fuzzing of a real icekv server: schemathesis draws requests from the frontend's
own ``/openapi.json`` (bodies it calls valid and bodies it calls invalid, every route) and sends
them to tritonserver with the icekv model behind icekv's HTTP frontend, on loopback. Every answer
must be a status the document lists, in its content type, with its family's body; never a 500, a
traceback or a server path. Afterwards the server must be idle (no request, page or promised
byte left) and answer a fixed greedy prompt as it did before. Saves json + md under ``--out``.

    .venv/bin/python bench/api_fuzz.py [--examples 1000] [--seed 0] [--out bench/results/api_fuzz]

``tests/serving/test_api_fuzz.py`` runs the same driver, short and derandomized, in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

# the server's settings: outputs kept short (generated bodies ask for anything up to INT32_MAX tokens)
SERVER_PARAMETERS = {"pool_tokens": "4096", "max_active_requests": "4", "default_max_tokens": "4",
                     "max_tokens_limit": "8", "max_compress_tokens": "1024"}
# what an idle server holds none of (pool pages in use: held by a request, or by a reference one never dropped)
LEAKS = ("icekv_active_requests", "icekv_queued_requests", "icekv_kv_host_bytes", "icekv_kv_pool_pages_in_use",
         "icekv_index_bytes_promised", "icekv_device_bytes_promised")
BUSY_OR_GONE = (499, 503, 504)  # documented statuses the schema checks skip: a request refused for load or time
PROBE = {"text_input": "The capital of France is", "max_tokens": 6, "temperature": 0}


@contextmanager
def serving(model_dir: str, work: Path) -> Iterator[tuple]:
    """(tritonserver, frontend) on loopback with :data:`SERVER_PARAMETERS`."""
    from icekv.serving.launcher import TritonServer, free_port
    from icekv.serving.openai.config import OpenAIConfig
    from icekv.serving.openai.process import OpenAIFrontendProcess

    params = {**SERVER_PARAMETERS, "model_dir": model_dir, "store": str(work / "contexts")}
    with TritonServer(params, log_path=work / "tritonserver.log") as server:
        config = OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port(), max_body_bytes=1 << 16,
                              idle_timeout_s=120)
        with OpenAIFrontendProcess(config, log_path=work / "frontend.log") as frontend:
            yield server, frontend


def _served_model(case_and_flag):
    """Half the valid OpenAI bodies name the served model, so that they reach the engine."""
    case, serve = case_and_flag
    if serve and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "icekv"
    return case


def check_answer(case, response) -> None:
    """AssertionError (or schemathesis's failure) where ``response`` breaks the contract."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    assert response.status_code != 500, response.text[:300]
    text = response.text
    assert "Traceback" not in text and "site-packages" not in text and "/icekv/" not in text, text[:300]
    if response.status_code not in BUSY_OR_GONE:
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance])


def fuzz(url: str, examples: int, seed: int | None = None, stop_at_failure: bool = True,
         on_answer: Callable[[str, int], None] | None = None) -> list[dict]:
    """Up to ``examples`` requests per operation (valid and invalid together) to the frontend at
    ``url``; ``seed`` None: derandomized. Returns the failures (an operation stops at its first,
    shrunk); with ``stop_at_failure`` the first one raises. ``on_answer(operation, status)``."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        path_parameters = {"model": "icekv"} if "{model}" in operation.path else None
        valid = st.tuples(operation.as_strategy(GenerationMode.POSITIVE, path_parameters=path_parameters),
                          st.booleans()).map(_served_model)
        invalid = operation.as_strategy(GenerationMode.NEGATIVE)

        @settings(max_examples=examples, deadline=None, derandomize=seed is None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(valid, invalid))
        def send(case):
            response = case.call(base_url=url, timeout=120)
            if on_answer:
                on_answer(label, response.status_code)
            check_answer(case, response)

        if seed is not None:
            send = hypothesis_seed(seed)(send)
        try:
            send()
        except Exception as e:  # hypothesis re-raises the shrunk failure
            if stop_at_failure:
                raise
            notes = "\n".join(getattr(e, "__notes__", []))  # schemathesis's reproduction (a curl command)
            failures.append({"operation": label, "failure": f"{e}\n{notes}"[-6000:]})
    return failures


def generate(frontend) -> str:
    req = urllib.request.Request(f"{frontend.url}/v2/models/icekv/generate", data=json.dumps(PROBE).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["text_output"]


def main(argv: list[str] | None = None) -> None:
    from soak import metrics  # bench/soak.py's reader of the icekv_ metrics (run as a script: bench/ is on the path)

    from icekv.serving.engine_loop import TICK_S

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="requests at most per operation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m", help="a known model's name or a model folder")
    ap.add_argument("--out", default="bench/results/api_fuzz")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    answered: dict[str, Counter] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="icekv-fuzz-") as tmp, \
            serving(args.model, Path(tmp)) as (server, frontend):
        before = generate(frontend)

        def on_answer(operation: str, status: int) -> None:
            answered.setdefault(operation, Counter())[status] += 1

        failures = fuzz(frontend.url, args.examples, args.seed, stop_at_failure=False, on_answer=on_answer)
        time.sleep(3 * TICK_S)  # the last requests' counters are pushed on a tick
        idle = metrics(server.metrics_port)
        after = generate(frontend)
    statuses = sum(answered.values(), Counter())
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "requests": sum(statuses.values()), "wall_s": round(time.monotonic() - started, 1),
        "statuses": dict(sorted(statuses.items())),
        "per_operation": {op: dict(sorted(c.items())) for op, c in sorted(answered.items())},
        "failures": failures, "left_after": {name: idle.get(name) for name in LEAKS},
        "same_answer_after": before == after,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# API fuzz\n\n`{result['command']}` at {result['commit']}, {result['date']}, {result['machine']}\n",
             f"- requests: {result['requests']} in {result['wall_s']} s; statuses {result['statuses']}",
             f"- failures: {len(failures)}", f"- left after the run: {result['left_after']}",
             f"- the probe answers as before: {result['same_answer_after']}\n", "| operation | statuses |", "|---|---|"]
    lines += [f"| {op} | {c} |" for op, c in result["per_operation"].items()]
    lines += [f"\n## {f['operation']}\n\n```\n{f['failure']}\n```" for f in failures]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:5]))
    ok = not failures and all(v == 0 for v in result["left_after"].values()) and result["same_answer_after"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
