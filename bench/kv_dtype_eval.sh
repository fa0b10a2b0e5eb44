#!/usr/bin/env bash
# Quantized KV pages against the model-dtype pool: the same contexts (seed 0) under full attention
# and icecache at budget 256, once per kv_dtype. fp32 models on a CPU, so int8 / fp8 rows are
# 0.27x the bytes. Resumable like bench/longctx_eval.sh (rerun the same command).
#   bash bench/kv_dtype_eval.sh smollm2   -> bench/results/kv_dtype_smollm2-135m_4k_<task>_<kv_dtype>[_n<SAMPLES>]/
#   bash bench/kv_dtype_eval.sh qwen      -> bench/results/kv_dtype_qwen2.5-coder-0.5b_16k_niah_multikey_<kv_dtype>/
#   bash bench/kv_dtype_eval.sh decode    -> bench/results/kv_dtype_decode_32k/<kv_dtype>_r<round>/
# decode: TPOT at 32k (SmolLM2, full and icecache, 3 interleaved repeats), the kv_dtypes alternating
# over ROUNDS rounds, in reverse order in even rounds, so each quantized run has a model-dtype run
# beside it and no format always runs last; alone on the cores.
# Environment: KV_DTYPES (auto int8 fp8_e4m3), TASKS (smollm2: niah_single niah_multikey), SAMPLES (20
# at 4k, 3 at 16k: 8 questions each), ROUNDS (decode: 2).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:?usage: bench/kv_dtype_eval.sh smollm2|qwen|decode}
KV_DTYPES=${KV_DTYPES:-auto int8 fp8_e4m3}
TASKS=${TASKS:-niah_single niah_multikey}
run() {  # out, then icekv eval's arguments
  local out=$1; shift
  local resume=()
  [ -f "$out/runs.jsonl" ] && resume=(--resume)
  .venv/bin/icekv eval --policies full,icecache --budgets 256 --search centroids --seed 0 --out "$out" "$@" "${resume[@]}"
}
if [ "$WHICH" = decode ]; then
  for round in $(seq "${ROUNDS:-2}"); do
    order=$KV_DTYPES
    [ $((round % 2)) = 0 ] && order=$(echo $KV_DTYPES | tr ' ' '\n' | tac | tr '\n' ' ')  # even rounds reversed
    for kv in $order; do
      .venv/bin/icekv bench decode --contexts 32768 --policies full,icecache --search centroids --repeats 3 \
        --kv-dtype "$kv" --out "bench/results/kv_dtype_decode_32k/${kv}_r$round"
    done
  done
  exit 0
fi
for kv in $KV_DTYPES; do
  if [ "$WHICH" = smollm2 ]; then
    # one needle asked per context (SmolLM2 answers 1 of 4 keyed needles at 4k), 3 distractors for multikey
    for task in $TASKS; do
      needles=$([ "$task" = niah_multikey ] && echo 4 || echo 2)
      run "bench/results/kv_dtype_smollm2-135m_4k_${task}_$kv${SAMPLES:+_n$SAMPLES}" --model smollm2-135m --task "$task" \
        --num-needles "$needles" --lengths 4096 --samples "${SAMPLES:-20}" --kv-dtype "$kv"
    done
  else  # the contexts of bench/longctx_eval.sh 16384 (its auto run holds the same first contexts)
    run "bench/results/kv_dtype_qwen2.5-coder-0.5b_16k_niah_multikey_$kv" --model qwen2.5-coder-0.5b \
      --task niah_multikey --questions 8 --num-needles 10 --lengths 16384 --samples "${SAMPLES:-3}" --kv-dtype "$kv"
  fi
done
