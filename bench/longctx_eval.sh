#!/usr/bin/env bash
# IceCache at length: Qwen2.5-Coder-0.5B-Instruct (trained to 32k), fp32, CPU. Each context holds
# QUESTIONS keyed needles (and distractors), each asked once, every (policy, budget) decoded from the
# context's one prefill. Runs of hours: each context is appended to runs.jsonl as it finishes and
# report.md is rewritten; rerun the same command to resume where it stopped.
#   bash bench/longctx_eval.sh 16384 [SAMPLES]   -> bench/results/longctx_16k_essays_niah_multikey_score_order/
# Environment:
#   TASK (niah_multikey), HAYSTACK (essays), BUDGETS (64,128,256), POLICIES (full,icecache,icecache_r,
#   quest,streaming), QUESTIONS (8 keyed needles asked per context), NUM_NEEDLES (niah_multikey: 10
#   in all), GQA_MERGE (unset: the engine's; head_order is the authors'), SEARCH (centroids), RERANK and
#   MIN_CANDIDATES (centroids: pages rescored per page selected, and at least; unset: the engine's
#   defaults), DISTINCT_KEY_WORDS (1: no two keys of a context share a word), PREFIX_STORE (where
#   each context's KV pages are kept, --prefix-store: default eval-prefixes in the cache directory).
#   These name the folder: _q<QUESTIONS> (niah_multikey _q<QUESTIONS>_n<NUM_NEEDLES>) but at 8/10,
#   _<GQA_MERGE> but head_order, _<SEARCH> but centroids, _rerank<N> and _candidates<N> when set, _dk.
# A resumed run must keep the grid it started with (the saved report.md names its command).
set -euo pipefail
cd "$(dirname "$0")/.."
LENGTH=${1:?usage: bench/longctx_eval.sh LENGTH [SAMPLES]}
SAMPLES=${2:-5}
TASK=${TASK:-niah_multikey}
BUDGETS=${BUDGETS:-64,128,256}
HAYSTACK=${HAYSTACK:-essays}
POLICIES=${POLICIES:-full,icecache,icecache_r,quest,streaming}
GQA_MERGE=${GQA_MERGE:-$(.venv/bin/python -c 'from icekv.methods.icecache import IceCacheConfig; print(IceCacheConfig().gqa_merge)')}
QUESTIONS=${QUESTIONS:-8}
NUM_NEEDLES=${NUM_NEEDLES:-10}
OUT="bench/results/longctx_$((LENGTH / 1024))k_${HAYSTACK}_${TASK}"
COUNTS="_q${QUESTIONS}"
[ "$TASK" = niah_multikey ] && COUNTS="${COUNTS}_n${NUM_NEEDLES}"
[ "$QUESTIONS/$NUM_NEEDLES" = 8/10 ] || OUT="${OUT}${COUNTS}"
[ "$GQA_MERGE" = head_order ] || OUT="${OUT}_${GQA_MERGE}"
SEARCH=${SEARCH:-centroids}
[ "$SEARCH" = centroids ] || OUT="${OUT}_${SEARCH}"
CANDIDATE_ARGS=()
if [ -n "${RERANK:-}" ]; then CANDIDATE_ARGS=(--rerank "$RERANK"); OUT="${OUT}_rerank${RERANK}"; fi
if [ -n "${MIN_CANDIDATES:-}" ]; then
  CANDIDATE_ARGS+=(--min-candidates "$MIN_CANDIDATES"); OUT="${OUT}_candidates${MIN_CANDIDATES}"
fi
KEYS=()
if [ "${DISTINCT_KEY_WORDS:-0}" = 1 ]; then KEYS=(--distinct-key-words); OUT="${OUT}_dk"; fi
STORE=(--prefix-store ${PREFIX_STORE:+"$PREFIX_STORE"})  # unset: the CLI's default directory
RESUME=()
[ -f "$OUT/runs.jsonl" ] && RESUME=(--resume)
.venv/bin/icekv eval --model qwen2.5-coder-0.5b --task "$TASK" --haystack "$HAYSTACK" --lengths "$LENGTH" \
  --questions "$QUESTIONS" --num-needles "$NUM_NEEDLES" "${KEYS[@]}" --policies "$POLICIES" --budgets "$BUDGETS" \
  --search "$SEARCH" "${CANDIDATE_ARGS[@]}" --gqa-merge "$GQA_MERGE" --samples "$SAMPLES" --seed 0 "${STORE[@]}" --out "$OUT" "${RESUME[@]}"
