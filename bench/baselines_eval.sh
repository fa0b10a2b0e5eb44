#!/usr/bin/env bash
# The IceCache paper's comparison, redone: every decode policy (the six baselines, quest, icecache,
# icecache_r and the full cache) at budgets 128-1024, each (policy, budget) decoded from one prefill
# of each context. Resumable like bench/longctx_eval.sh (rerun the same command).
#   bash bench/baselines_eval.sh MODEL LENGTH [SAMPLES]
#   bash bench/baselines_eval.sh smollm2-135m 4096 40        -> bench/results/baselines_smollm2-135m_4k_essays_niah_single_b128-256-512-1024/
#   bash bench/baselines_eval.sh qwen2.5-coder-0.5b 16384 5  -> bench/results/baselines_qwen2.5-coder-0.5b_16k_essays_niah_multikey_b128-256-512-1024/
# Environment: TASK (niah_single on smollm2-135m, niah_multikey otherwise), HAYSTACK (essays),
# BUDGETS (128,256,512,1024), QUESTIONS (1 on smollm2-135m: with 4 keyed needles at 4k its full cache
# answered 1 of 4; 8 otherwise: keyed needles asked per context), POLICIES (every one; another list names
# the folder: _<policies>, e.g. a method rerun at new defaults beside the others' run), PREFIX_STORE (each
# context's KV pages, --prefix-store: default eval-prefixes in the cache directory; a resumed context is read
# back, not prefilled).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bench/baselines_eval.sh MODEL LENGTH [SAMPLES]}
LENGTH=${2:?usage: bench/baselines_eval.sh MODEL LENGTH [SAMPLES]}
SAMPLES=${3:-5}
if [ "$MODEL" = smollm2-135m ]; then TASK=${TASK:-niah_single}; QUESTIONS=${QUESTIONS:-1}
else TASK=${TASK:-niah_multikey}; QUESTIONS=${QUESTIONS:-8}; fi
HAYSTACK=${HAYSTACK:-essays}
BUDGETS=${BUDGETS:-128,256,512,1024}
EVERY=full,icecache,icecache_r,quest,streaming,snapkv,arkvale,pqcache,omnikv,magicpig
POLICIES=${POLICIES:-$EVERY}
OUT="bench/results/baselines_${MODEL}_$((LENGTH / 1024))k_${HAYSTACK}_${TASK}_b${BUDGETS//,/-}"
[ "$POLICIES" = "$EVERY" ] || OUT="${OUT}_${POLICIES//,/-}"
# the finished log is kept gzip'd (one question's per-layer recall makes it megabytes): unpack it to resume
[ -f "$OUT/runs.jsonl.gz" ] && [ ! -f "$OUT/runs.jsonl" ] && gunzip -k "$OUT/runs.jsonl.gz"
STORE=(--prefix-store ${PREFIX_STORE:+"$PREFIX_STORE"})  # unset: the CLI's default directory
RESUME=()
[ -f "$OUT/runs.jsonl" ] && RESUME=(--resume)
.venv/bin/icekv eval --model "$MODEL" --task "$TASK" --haystack "$HAYSTACK" --lengths "$LENGTH" \
  --questions "$QUESTIONS" --num-needles $((QUESTIONS + 2)) --policies "$POLICIES" --budgets "$BUDGETS" \
  --search centroids --samples "$SAMPLES" --seed 0 "${STORE[@]}" --out "$OUT" "${RESUME[@]}"
gzip -9 -f "$OUT/runs.jsonl"
