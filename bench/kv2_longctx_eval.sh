#!/usr/bin/env bash
# KV² at the length its paper measures: Qwen2.5-Coder-0.5B-Instruct (trained to 32k), fp32, CPU.
# Each context is prefilled once, compressed by every method at every budget, and each compressed
# copy is asked all of the context's keyed needles. Runs of hours: each context is appended to
# runs.jsonl as it finishes and report.md is rewritten; rerun the same command to resume.
#   bash bench/kv2_longctx_eval.sh 16384 [SAMPLES]   -> bench/results/kv2_qwen2.5-coder-0.5b_16k_essays_niah_multikey/
# Environment: TASK (niah_multikey), HAYSTACK (essays), QUESTIONS (8 needles, each asked),
# METHODS (kv2,kvzip,snapkv,keydiff), KV_BUDGETS (0.02,0.05,0.1,0.25).
set -euo pipefail
cd "$(dirname "$0")/.."
LENGTH=${1:?usage: bench/kv2_longctx_eval.sh LENGTH [SAMPLES]}
SAMPLES=${2:-5}
TASK=${TASK:-niah_multikey}
HAYSTACK=${HAYSTACK:-essays}
QUESTIONS=${QUESTIONS:-8}
METHODS=${METHODS:-kv2,kvzip,snapkv,keydiff}
KV_BUDGETS=${KV_BUDGETS:-0.02,0.05,0.1,0.25}
OUT="bench/results/kv2_qwen2.5-coder-0.5b_$((LENGTH / 1024))k_${HAYSTACK}_${TASK}"
RESUME=()
[ -f "$OUT/runs.jsonl" ] && RESUME=(--resume)
.venv/bin/icekv eval --model qwen2.5-coder-0.5b --compress "$METHODS" --kv-budgets "$KV_BUDGETS" \
  --task "$TASK" --haystack "$HAYSTACK" --lengths "$LENGTH" --questions "$QUESTIONS" --samples "$SAMPLES" \
  --seed 0 --out "$OUT" "${RESUME[@]}"
