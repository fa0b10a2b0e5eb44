#!/usr/bin/env bash
# The GPU check: one command on a lent CUDA machine (its parts' limits sum to 580 s, under the
# device tool's 600 s a command), everything written under one folder: engine parity CPU vs CUDA
# (bench/engine_parity.py); decode time per token of a random-weight Llama-3.1-8B (bf16, budget
# 256) at 32k and at 128k (with transformers as the peer there, where its ratio is a target) under
# full attention and IceCache; the kernel tests natively (bf16 included, int8 / fp8 KV pages too);
# batched decode at batch 1 and 8 x 32k; one layer's centroids search on the host vs on the device
# (bench/centroid_scoring.py); kernel timings vs torch SDPA, the sparse decode also over int8 / fp8
# pages (bench/gpu_kernels.py); icecache at 32k with the candidates rescored on the device; icecache
# over int8 KV pages at 32k and 128k (bytes moved per step, TPOT). The
# bench parts' arguments are in bench/gpu_parts.py. Each part has its own time limit and output,
# written as it measures, so one that fails or runs long loses only what it had not measured; each
# bench first checks its plan (every wave admitted at once, memory within the machine's) and
# refuses before any prefill.
#
#   bash bench/gpu_check.sh            on the GPU: results in bench/results/gpu/<date>-<commit>/
#                                      (under the device tool, $OUT set: packed into $OUT/gpu_check.tgz
#                                      after each part, the summary beside it)
#   bash bench/gpu_check.sh --dry-run  on a CPU: every part through the same code paths with shrunk
#                                      shapes (llama-tiny, 2-4k tokens, the host pools declared off the
#                                      compute device), then the real run's admission and memory plan
#   bash bench/gpu_check.sh --plan     only the real run's plan (Llama-3.1-8B, 128 GiB host, the smaller lent GPU's memory)
#
# Uses the machine's own torch + triton (no network needed); ICEKV_COMMIT names the commit where the
# copy has no git history; PYTHON the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=real
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --plan) MODE=plan ;;
  "") ;;
  *) echo "gpu_check: unknown option $1 (--dry-run | --plan)" >&2; exit 2 ;;
esac
export PYTHONPATH="$PWD/python_backend:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch; set PYTHON to an interpreter that can (here: PYTHON=.venv/bin/python)" >&2
  exit 2
fi
if [ "$MODE" = plan ]; then exec "$PY" bench/gpu_parts.py --plan; fi
COMMIT="${ICEKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
RUN="$(date -u +%Y%m%d)-$COMMIT"
if [ "$MODE" = dry ]; then
  OUT_DIR="${GPU_CHECK_DIR:-/tmp/icekv-gpu-dry-run/$RUN}"
  ICEKV=("$PY" bench/off_device.py)  # the host pools declared off the compute device, as on a GPU
  DEVICE=cpu
  export TRITON_INTERPRET=1  # the kernel tests and timings in triton's interpreter
else
  OUT_DIR="${OUT:+/tmp/icekv-gpu-check/$RUN}"
  OUT_DIR="${OUT_DIR:-bench/results/gpu/$RUN}"
  ICEKV=("$PY" -m icekv.cli)
  DEVICE=cuda
  unset TRITON_INTERPRET
fi
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
pack() {  # under the device tool: everything so far into one archive (a temporary name, then moved)
  if [ -n "${OUT:-}" ] && [ "$MODE" = real ]; then
    tar -czf "$OUT/gpu_check.tgz.part" -C "$OUT_DIR" . && mv -f "$OUT/gpu_check.tgz.part" "$OUT/gpu_check.tgz"
    cp "$OUT_DIR/summary.txt" "$OUT/summary.txt.part" && mv -f "$OUT/summary.txt.part" "$OUT/summary.txt"
  fi
}
part() {  # part NAME SECONDS COMMAND...: run it; its stdout in NAME.txt, stderr in NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.txt" 2> "$OUT_DIR/$name.log"
  local rc=$?
  local why=""; [ $rc -eq 124 ] || [ $rc -eq 137 ] && why=" (cut at its limit)"
  echo "$name: rc $rc$why in $((SECONDS - t0)) s (limit $limit)" | tee -a "$OUT_DIR/summary.txt"
  tail -3 "$OUT_DIR/$name.log"
  pack
}
bench_part() {  # bench_part NAME SECONDS: an `icekv bench` part, its arguments from bench/gpu_parts.py
  local name=$1 limit=$2 args
  mapfile -t args < <("$PY" bench/gpu_parts.py "$name" ${DRY_FLAG:-})
  part "$name" "$limit" "${ICEKV[@]}" "${args[@]}"
}
limit() {  # limit REAL_SECONDS [DRY_SECONDS]: a part's limit (the dry run's CPU gets looser ones)
  if [ "$MODE" = dry ]; then echo "${2:-$(( $1 * 2 > 120 ? $1 * 2 : 120 ))}"; else echo "$1"; fi
}
[ "$MODE" = dry ] && DRY_FLAG=--dry-run
{ if [ "$MODE" = real ]; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; fi
  "$PY" - <<'EOF'
import importlib
for name in ("torch", "triton", "numpy", "numba", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # reported, not fatal: the parts that need it will say so
        print(name, "MISSING:", type(e).__name__, e)
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import icekv.cli, icekv.engine  # noqa: F401
    print("import icekv: ok")
except Exception as e:
    print("import icekv: FAILED:", type(e).__name__, e)
EOF
  echo "commit $COMMIT ($MODE run)"; date -u; } > "$OUT_DIR/device.txt" 2>&1
cat "$OUT_DIR/device.txt"
# most important first: a part that runs long loses only itself; the limits sum to 580 s
# First the compiled CPU loops (numba, cached on disk for the later parts: about a minute cold)
part warmup "$(limit 60)" "$PY" -c "from icekv.engine.compile_loops import compile_loops; import torch; \
[compile_loops(d) for d in (torch.float32, torch.bfloat16)]"
if [ "$MODE" = real ]; then PARITY=(); else PARITY=(--lengths 100,400,800); fi
part engine_parity "$(limit 60 180)" "$PY" bench/engine_parity.py --device "$DEVICE" "${PARITY[@]}" \
    --out "$OUT_DIR/engine_parity.json"
bench_part decode_32k "$(limit 55)"
if [ "$MODE" = real ]; then KERNEL_ENV=(env ICEKV_TEST_DEVICE=cuda); else KERNEL_ENV=(env); fi
part kernel_tests "$(limit 95)" "${KERNEL_ENV[@]}" "$PY" -m pytest tests/kernels -v -p no:cacheprovider \
    --junitxml="$OUT_DIR/kernel_tests.xml"
bench_part decode_128k "$(limit 100)"
bench_part batch_32k "$(limit 70)"
if [ "$MODE" = real ]; then SCORING=(--contexts 32768,131072); else SCORING=(--contexts 2048,4096 --repeats 3); fi
part centroid_scoring "$(limit 30)" "$PY" bench/centroid_scoring.py --device "$DEVICE" "${SCORING[@]}" \
    --out "$OUT_DIR/centroid_scoring.json"
if [ "$MODE" = real ]; then KERNELS=(); else KERNELS=(--contexts 2048); fi
part gpu_kernels "$(limit 30)" "$PY" bench/gpu_kernels.py --device "$DEVICE" "${KERNELS[@]}" --out "$OUT_DIR/gpu_kernels.json"
bench_part decode_32k_rescoring "$(limit 40)"
bench_part decode_int8 "$(limit 40)"
if [ "$MODE" = dry ]; then  # what the real run will admit and hold, at its shapes
  "$PY" bench/gpu_parts.py --plan > "$OUT_DIR/plan.txt" 2>&1
  echo "plan: rc $? ($(tail -1 "$OUT_DIR/plan.txt"))" | tee -a "$OUT_DIR/summary.txt"
fi
"$PY" bench/gpu_targets.py "$OUT_DIR" >> "$OUT_DIR/summary.txt" 2>&1  # each target: met, missed or missing
pack
echo "results: $OUT_DIR"
cat "$OUT_DIR/summary.txt"
