"""icekv against the engines users already run, side by side in one run: vLLM's CPU build
(``--vllm-dtypes``) and llama.cpp (the model's own GGUF), each in its own venv
(``bash bench/peers/setup.sh``) and its own process, one after the other, on the same token ids
and ``--threads`` threads. Each engine is timed by ``time_engine.py``: prefill, time per output
token, the conversation's next turn's time to first token through the engine's prefix cache, and
peak memory. The report states each engine's weight format and whether the CPU has bf16 units.

    bash bench/peers/setup.sh
    .venv/bin/python bench/peers/run.py [--model qwen2.5-coder-0.5b] [--context 16384] [--tokens 32] \\
        [--engines icekv,vllm,llamacpp] [--icekv-policies icecache,full] [--icekv-weights auto,int8] \\
        [--vllm-dtypes bfloat16,float32] [--out bench/results/peers_X]

``--shape llama-3.1-8b`` runs a model of that shape with random weights instead of ``--model``
(latency does not depend on the values): icekv's random-weight model, vLLM's dummy weights on the
shape's ``config.json``, and for llama.cpp a GGUF of random Q8_0 blocks written by
``random_gguf.py``. The prompt is then random token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from icekv.assets import Assets
from icekv.model import ModelArgs, Tokenizer, shape_args
from icekv.model.linear import bf16_units
from icekv.model.random import SHAPES

ROOT = Path(__file__).resolve().parents[2]
VENVS = {"icekv": ".venv", "vllm": ".venv-vllm", "llamacpp": ".venv-llamacpp"}
FOLLOW_UP_TOKENS = 100  # the next turn's new tokens


def prompt_ids(model_dir: Path, context: int) -> dict:
    """The prompt (``context`` tokens of the essays) and the next turn's new tokens, as ids."""
    ids = Tokenizer(model_dir).encode(Assets().haystack_text("essays"))
    if len(ids) < context + FOLLOW_UP_TOKENS:
        raise SystemExit(f"the essays hold {len(ids)} tokens, fewer than --context {context} + {FOLLOW_UP_TOKENS}")
    return {"prompt": ids[:context], "follow_up": ids[context:context + FOLLOW_UP_TOKENS]}


def random_prompt_ids(args: ModelArgs, context: int, seed: int = 0) -> dict:
    """Random ids of a shape's vocabulary, for a model of random weights (``--shape``)."""
    ids = torch.randint(args.vocab_size, (context + FOLLOW_UP_TOKENS,), generator=torch.Generator().manual_seed(seed))
    return {"prompt": ids[:context].tolist(), "follow_up": ids[context:].tolist()}


def hf_config(args: ModelArgs, name: str) -> dict:
    """A Hugging Face ``config.json`` of a Llama shape: what vLLM builds its dummy-weight model
    from, and ``random_gguf.py`` its GGUF."""
    if args.architecture != "LlamaForCausalLM" or args.qkv_bias or args.qk_norm:
        raise SystemExit(f"--shape {name}: only plain Llama shapes have a config.json and a GGUF here")
    return {"_name_or_path": name, "architectures": [args.architecture], "model_type": "llama",
            "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_layers,
            "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
            "head_dim": args.head_dim, "rms_norm_eps": args.rms_norm_eps, "rope_theta": args.rope_theta,
            "rope_scaling": args.rope_scaling, "max_position_embeddings": args.max_position_embeddings,
            "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": args.qkv_bias, "mlp_bias": False,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def random_shape_files(shape: str, scratch: Path, engines: list[str]) -> tuple[Path, Path]:
    """The shape's ``config.json`` folder (vLLM's dummy weights) and, where llama.cpp runs, its
    random GGUF, written in ``scratch``."""
    model_dir = scratch / shape
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(shape_args(shape), shape), indent=1))
    gguf = scratch / f"{shape}-random-q8_0.gguf"
    if "llamacpp" in engines:
        python = _venv_python("llamacpp")
        subprocess.run([str(python), str(Path(__file__).with_name("random_gguf.py")), str(model_dir / "config.json"),
                        str(gguf)], check=True, cwd=ROOT)
    return model_dir, gguf


def _venv_python(engine: str) -> Path:
    python = ROOT / VENVS[engine] / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run bash bench/peers/setup.sh")
    return python


def time_one(engine: str, variant: list[str], ids_file: Path, model_dir: Path, gguf: Path, args) -> dict:
    """``engine``'s record from ``time_engine.py``, run with the flags of one ``variant``."""
    shape = ["--random-weights", args.shape] if args.shape else []
    command = [str(_venv_python(engine)), str(Path(__file__).with_name("time_engine.py")), "--engine", engine,
               "--ids", str(ids_file), "--model-dir", str(model_dir), "--gguf", str(gguf), "--tokens", str(args.tokens),
               "--budget", str(args.budget), "--vllm-kv-gib", str(args.vllm_kv_gib), "--threads", str(args.threads),
               *shape, *variant]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python_backend")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def machine() -> str:
    """The CPU's model and cores, and whether it has the bf16 units that decide each engine's
    fastest dtype."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.machine())
    units = "with" if bf16_units(torch.device("cpu")) else "without"
    return f"{model}, {os.cpu_count()} cores, {units} bf16 units, CPU only"


def report(result: dict) -> str:
    """The markdown table of ``result``'s records, each against the first icekv record (or the
    first record, where icekv was not run)."""
    records = result["records"]
    base = next((r for r in records if r["engine"] == "icekv"), records[0])
    rows = ["| engine (weights) | prefill s | time per output token ms | next turn: time to first token s "
            f"(cached tokens) | peak memory MiB | per token / {base['engine']}'s |", "|---|---|---|---|---|---|"]
    for r in records:
        rows.append(f"| {r['label']} | {r['prefill_s']:.1f} | {1e3 * r['tpot_s']:.1f} | {r['next_turn_ttft_s']:.2f} "
                    f"({r['next_turn_cached']:,} of {r['next_turn_tokens']:,}) | {r['peak_rss_mib']:.0f} "
                    f"| {r['tpot_s'] / base['tpot_s']:.2f}x |")
    return "\n".join([
        f"# icekv and its peers: {result['model']}, {result['context']:,}-token prompt", "",
        f"`{result['command']}` on {result['machine']}, commit {result['commit']}, {result['date']}; one engine "
        f"at a time on {records[0]['threads']} threads; the same token ids; greedy, one request at a time. "
        "Prefill: the prompt cold, after a warm-up on the prompt reversed. The next turn is the prompt, the "
        f"engine's own {result['tokens'] + 2}-token answer and {FOLLOW_UP_TOKENS} new tokens. Time per output "
        "token: the median gap between tokens from the third on. Peak memory: the engine's processes together "
        f"(vLLM's includes its KV pool, {result['vllm_kv_gib']} GiB allocated at start).",
        "", *rows, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="instead of --model, a model of this shape with random weights (icekv.model.random)")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=32, help="timed decode tokens")
    parser.add_argument("--engines", default="icekv,vllm,llamacpp")
    parser.add_argument("--icekv-policies", default="icecache", help="icekv runs once per policy and weights")
    parser.add_argument("--icekv-weights", default="auto", help="icekv's weight formats (icekv --weights)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV pool (allocated whole at its start)")
    parser.add_argument("--vllm-dtypes", default="bfloat16",
                        help="vLLM runs once per dtype (bfloat16, float32: a CPU without bf16 units emulates bf16)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="every engine's")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engines = args.engines.split(",")
    if unknown := set(engines) - set(VENVS):
        raise SystemExit(f"unknown engines {sorted(unknown)}; known: {', '.join(VENVS)}")
    variants = {"icekv": [["--icekv-policy", p, "--icekv-weights", w] for w in args.icekv_weights.split(",")
                          for p in args.icekv_policies.split(",")],
                "vllm": [["--vllm-dtype", d] for d in args.vllm_dtypes.split(",")], "llamacpp": [[]]}
    records = []
    with tempfile.TemporaryDirectory(prefix="icekv-peers-") as scratch:
        if args.shape:
            model_dir, gguf = random_shape_files(args.shape, Path(scratch), engines)
            ids = random_prompt_ids(shape_args(args.shape), args.context)
        else:
            assets = Assets()
            model_dir = assets.model_dir(args.model)
            gguf = assets.model_gguf(args.model) if "llamacpp" in engines else Path("-")
            ids = prompt_ids(model_dir, args.context)
        ids_file = Path(scratch) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        for engine, variant in [(e, v) for e in engines for v in variants[e]]:
            records.append(time_one(engine, variant, ids_file, model_dir, gguf, args))
            print(json.dumps({k: v for k, v in records[-1].items() if k != "decode_gaps_s"}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    model = f"{args.shape} (random weights)" if args.shape else args.model
    result = {"command": " ".join(["bench/peers/run.py", *sys.argv[1:]]), "model": model, "context": args.context,
              "tokens": args.tokens, "vllm_kv_gib": args.vllm_kv_gib,
              "machine": machine(),
              "commit": commit.strip(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "records": records}
    table = report(result)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        (args.out / "report.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
