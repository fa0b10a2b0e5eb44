#!/usr/bin/env bash
# One command on a CUDA machine (at most about 8 minutes), everything written under $OUT (or
# bench/results/gpu/): engine parity CPU vs CUDA (bench/engine_parity.py); decode time per token
# of a random-weight Llama-3.1-8B (bf16, budget 256) at 32k and 128k tokens under full attention
# and IceCache with transformers as the peer; the kernel tests natively (bf16 included); batched
# decode at batch 1 and 8 x 32k; one layer's centroids search with the centroids ranked and the
# candidates rescored on the host vs on the device (bench/centroid_scoring.py); kernel timings vs
# torch SDPA (bench/gpu_kernels.py); icecache at 32k with the candidates rescored on the device.
# Each part has its own time limit and output, so one that fails or runs long loses only itself.
# Uses the machine's own torch + triton (no network needed). Under the device tool ($OUT set, which
# takes back at most 8 files) the parts' files are packed into $OUT/gpu_check.tgz after each part;
# ICEKV_COMMIT names the commit where the copy has no git history.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:+/tmp/icekv-gpu-check}"
OUT_DIR="${OUT_DIR:-bench/results/gpu}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/python_backend:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
unset TRITON_INTERPRET
ICEKV="$PY -m icekv.cli"
pack() {  # under the device tool: everything so far into one archive, the summary beside it
  if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu_check.tgz" -C "$OUT_DIR" . && cp "$OUT_DIR/summary.txt" "$OUT/"; fi
}
part() {  # part NAME SECONDS COMMAND...: run it; its stdout in NAME.txt, stderr in NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT_DIR/$name.txt" 2> "$OUT_DIR/$name.log"
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s (limit $limit)" | tee -a "$OUT_DIR/summary.txt"
  tail -3 "$OUT_DIR/$name.log"
  pack
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${ICEKV_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; } | tee "$OUT_DIR/device.txt"
: > "$OUT_DIR/summary.txt"
# most important first: a part that runs long loses only itself. The limits sum to 625 s: the last
# part is the one a run cut at 600 s loses (each part's files are packed as it ends).
# First the compiled CPU loops (numba, cached on disk for the later parts: about a minute cold)
part warmup 80 "$PY" -c "from icekv.engine.compile_loops import compile_loops; import torch; \
[compile_loops(d) for d in (torch.float32, torch.bfloat16)]"
part engine_parity 75 "$PY" bench/engine_parity.py --device cuda --out "$OUT_DIR/engine_parity.json"
DECODE=(bench decode --device cuda --random-weights llama-3.1-8b --policies full,icecache --budget 256
        --search centroids --steps 16 --peer hf --json)  # --json on stdout: no plotting library needed
part decode_32k 90 $ICEKV "${DECODE[@]}" --contexts 32768
part kernel_tests 100 env ICEKV_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/kernel_tests.xml"
part decode_128k 110 $ICEKV "${DECODE[@]}" --contexts 131072
part batch_32k 70 $ICEKV bench batch --device cuda --random-weights llama-3.1-8b --contexts 32768 --batch 1,8 \
    --policies full,icecache --budget 256 --search centroids --steps 16 --json
part centroid_scoring 30 "$PY" bench/centroid_scoring.py --device cuda --contexts 32768,131072 \
    --out "$OUT_DIR/centroid_scoring.json"
part gpu_kernels 25 "$PY" bench/gpu_kernels.py --out "$OUT_DIR/gpu_kernels.json"
part decode_32k_rescoring 45 $ICEKV bench decode --device cuda --random-weights llama-3.1-8b --policies icecache \
    --budget 256 --search centroids --rescoring device --steps 16 --json --contexts 32768
"$PY" bench/gpu_targets.py "$OUT_DIR" >> "$OUT_DIR/summary.txt" 2>&1  # each target: met, missed or missing
pack
cat "$OUT_DIR/summary.txt"
