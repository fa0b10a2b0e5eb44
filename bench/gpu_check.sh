#!/usr/bin/env bash
# One command on a CUDA machine (< 8 minutes): the kernel tests natively (bf16 included), then
# kernel timings vs torch SDPA full attention at 32k and 128k tokens (Llama-3.1-8B head shapes).
# Uses the machine's own torch + triton (no network needed); writes results under $OUT or
# bench/results/gpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/results/gpu}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/python_backend:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT_DIR/device.txt"
unset TRITON_INTERPRET
set +e
ICEKV_TEST_DEVICE=cuda timeout 300 "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/kernel_tests.xml" 2>&1 | tail -25 | tee "$OUT_DIR/kernel_tests.txt"
set -e
timeout 150 "$PY" bench/gpu_kernels.py --out "$OUT_DIR/gpu_kernels.json" | tee "$OUT_DIR/gpu_kernels.txt"
