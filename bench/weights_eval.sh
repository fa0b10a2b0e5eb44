#!/usr/bin/env bash
# Narrower weights against the fp32 model: the same contexts (seed 0) under full attention and
# icecache at budget 256, once per weight format, as bench/kv_dtype_eval.sh does for KV pages.
# Resumable (rerun the same command).
#   bash bench/weights_eval.sh smollm2   -> bench/results/weights_smollm2-135m_4k_<task>_<weights>/
#   bash bench/weights_eval.sh qwen      -> bench/results/weights_qwen2.5-coder-0.5b_16k_niah_multikey_<weights>/
# Environment: WEIGHTS (auto bfloat16 int8 int4), TASKS (smollm2: niah_single niah_multikey), SAMPLES
# (20 at 4k, 3 at 16k: 8 questions each).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:?usage: bench/weights_eval.sh smollm2|qwen}
run() {  # out, then icekv eval's arguments
  local out=$1; shift
  local resume=()
  [ -f "$out/runs.jsonl" ] && resume=(--resume)
  .venv/bin/icekv eval --policies full,icecache --budgets 256 --seed 0 --out "$out" "$@" "${resume[@]}"
}
for weights in ${WEIGHTS:-auto bfloat16 int8 int4}; do
  if [ "$WHICH" = smollm2 ]; then
    for task in ${TASKS:-niah_single niah_multikey}; do
      needles=$([ "$task" = niah_multikey ] && echo 4 || echo 2)
      run "bench/results/weights_smollm2-135m_4k_${task}_$weights" --model smollm2-135m --task "$task" \
        --num-needles "$needles" --lengths 4096 --samples "${SAMPLES:-20}" --weights "$weights"
    done
  else  # the contexts of bench/kv_dtype_eval.sh qwen
    run "bench/results/weights_qwen2.5-coder-0.5b_16k_niah_multikey_$weights" --model qwen2.5-coder-0.5b \
      --task niah_multikey --questions 8 --num-needles 10 --lengths 16384 --samples "${SAMPLES:-3}" --weights "$weights"
  fi
done
