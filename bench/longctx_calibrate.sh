#!/usr/bin/env bash
# Task calibration at length: the full cache alone on each task and haystack, so that a task's
# settings (needles asked, distractors, values, hops) can be chosen where the full cache scores
# >= 90% before sparse policies are compared on it. One resumable `icekv eval --policies full`
# per (task, haystack), fp32, CPU; rerun the same command to resume.
#   bash bench/longctx_calibrate.sh LENGTH [SAMPLES]
#     -> bench/results/calibration_<model>_<N>k/<task>_<haystack>_<settings>/
# Environment: MODEL (qwen2.5-coder-0.5b), TASKS (niah_single,niah_multikey,niah_multivalue,
# variable_tracking), HAYSTACKS (essays,kjv), QUESTIONS (4 asked per context), NUM_NEEDLES
# (niah_multikey: needles in all, 6), NUM_VALUES (niah_multivalue: 2), NUM_HOPS (variable_tracking: 4),
# DISTINCT_KEY_WORDS (1: no two keys share a word, --distinct-key-words; folder suffix _dk),
# CHAT_TEMPLATE (1: each question a user turn of the model's chat template, --chat-template; suffix
# _chat), PREFIX_STORE (where each context's KV pages are kept, --prefix-store, so that a rerun over
# the same contexts reads them back: default eval-prefixes in the cache directory).
set -euo pipefail
cd "$(dirname "$0")/.."
LENGTH=${1:?usage: bench/longctx_calibrate.sh LENGTH [SAMPLES]}
SAMPLES=${2:-2}
MODEL=${MODEL:-qwen2.5-coder-0.5b}
TASKS=${TASKS:-niah_single,niah_multikey,niah_multivalue,variable_tracking}
HAYSTACKS=${HAYSTACKS:-essays,kjv}
QUESTIONS=${QUESTIONS:-4}
NUM_NEEDLES=${NUM_NEEDLES:-6}
NUM_VALUES=${NUM_VALUES:-2}
NUM_HOPS=${NUM_HOPS:-4}
KEYS=()
SUFFIX=""
if [ "${DISTINCT_KEY_WORDS:-0}" = 1 ]; then KEYS=(--distinct-key-words); SUFFIX=_dk; fi
if [ "${CHAT_TEMPLATE:-0}" = 1 ]; then KEYS+=(--chat-template); SUFFIX="${SUFFIX}_chat"; fi
STORE=(--prefix-store ${PREFIX_STORE:+"$PREFIX_STORE"})  # unset: the CLI's default directory
ROOT="bench/results/calibration_${MODEL}_$((LENGTH / 1024))k"
for task in ${TASKS//,/ }; do
  case "$task" in
    niah_multikey) settings=(--num-needles "$NUM_NEEDLES"); name="q${QUESTIONS}_n${NUM_NEEDLES}" ;;
    niah_multivalue) settings=(--num-values "$NUM_VALUES"); name="q${QUESTIONS}_v${NUM_VALUES}" ;;
    variable_tracking) settings=(--num-hops "$NUM_HOPS" --max-tokens 32); name="q${QUESTIONS}_h${NUM_HOPS}" ;;  # 5 names to answer
    *) settings=(); name="q${QUESTIONS}" ;;
  esac
  for haystack in ${HAYSTACKS//,/ }; do
    OUT="$ROOT/${task}_${haystack}_${name}${SUFFIX}"
    RESUME=()
    [ -f "$OUT/runs.jsonl" ] && RESUME=(--resume)
    .venv/bin/icekv eval --model "$MODEL" --task "$task" --haystack "$haystack" --lengths "$LENGTH" \
      --questions "$QUESTIONS" "${settings[@]}" "${KEYS[@]}" --policies full --samples "$SAMPLES" --seed 0 \
      "${STORE[@]}" --out "$OUT" "${RESUME[@]}"
  done
done
