#!/usr/bin/env bash
# The saved KV² accuracy runs: kv2 (its defaults) against kvzip, snapkv, keydiff and streaming on
# reusable contexts, both tasks, both texts, with and without the chat template (HAYSTACKS, TEMPLATES
# pick a subset).
# SmolLM2-135M, fp32, CPU. Writes bench/results/kv2_eval_<haystack>[_chat]/.
# niah_multikey asks 4 questions per context, niah_single 1: SINGLE and MULTI contexts per task
# (40 niah_single contexts and 10 niah_multikey contexts give 40 questions per cell).
set -euo pipefail
cd "$(dirname "$0")/.."
SINGLE=${SINGLE:-40}
MULTI=${MULTI:-10}
HAYSTACKS=${HAYSTACKS:-essays kjv}
TEMPLATES=${TEMPLATES:-plain chat}  # plain: the question as is; chat: inside the chat template
for hay in $HAYSTACKS; do
  for template in $TEMPLATES; do
    chat=$([ "$template" = chat ] && echo --chat-template || true)
    out="bench/results/kv2_eval_${hay}${chat:+_chat}"
    for task in niah_single niah_multikey; do
      samples=$([ "$task" = niah_single ] && echo "$SINGLE" || echo "$MULTI")
      .venv/bin/icekv eval --compress kv2,kvzip,snapkv,keydiff,streaming --kv-budgets 0.02,0.05,0.1,0.25 \
        --task "$task" --haystack "$hay" --lengths 1000 --samples "$samples" --questions 4 --seed 0 $chat \
        --out "$out/$task"
    done
  done
done
