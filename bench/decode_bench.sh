#!/usr/bin/env bash
# The saved decode-speed runs (performance issue). SmolLM2-135M, fp32, CPU; run nothing else meanwhile.
# Writes bench/results/decode*/{results.json,report.md,tpot.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
I=.venv/bin/icekv
ARGS=(--contexts 4096,8192,16384,32768 --policies full,icecache,icecache_r --budget 256 --steps 16)
$I bench decode "${ARGS[@]}" --search walk --peer hf --out bench/results/decode
$I bench decode "${ARGS[@]}" --search centroids --repeats 3 --peer hf --out bench/results/decode_centroids
$I bench decode "${ARGS[@]}" --search centroids --unlimited-layers 0 --out bench/results/decode_centroids_all_layers_budgeted
$I bench decode "${ARGS[@]}" --search exhaustive --out bench/results/decode_exhaustive
$I bench decode "${ARGS[@]}" --search walk --unlimited-layers 0 --out bench/results/decode_all_layers_budgeted
$I bench decode "${ARGS[@]}" --search walk --score-dtype bfloat16 --out bench/results/decode_bf16_scores
$I bench decode "${ARGS[@]}" --score-dtype bfloat16 --search exhaustive --out bench/results/decode_bf16_exhaustive
$I bench decode "${ARGS[@]}" --score-dtype bfloat16 --search centroids --out bench/results/decode_centroids_bf16
$I bench decode "${ARGS[@]}" --score-dtype int8 --search centroids --out bench/results/decode_centroids_int8
$I bench decode "${ARGS[@]}" --score-dtype int8 --search centroids --unlimited-layers 0 \
    --out bench/results/decode_centroids_int8_all_layers_budgeted
# time to first token needs real prefills (16k: ~4 minutes on 2 cores)
$I bench decode --contexts 4096,16384 --policies full,icecache,icecache_r --budget 256 --steps 8 \
    --search centroids --ttft-contexts 4096,16384 --out bench/results/decode_ttft
