#!/usr/bin/env bash
# The saved IceCache accuracy run (issue: IceCache decode). SmolLM2-135M, fp32, CPU.
# Writes bench/results/icecache_eval_<haystack>/{results.json,report.md,accuracy.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${SAMPLES:-5}
for hay in essays kjv; do
  .venv/bin/icekv eval --task niah_single,niah_multikey --haystack "$hay" \
    --lengths 2000,3000,4000 --policies full,streaming,quest,icecache --budgets 64,128,256 \
    --search walk --samples "$SAMPLES" --seed 0 --out "bench/results/icecache_eval_$hay"  # the saved run's search
done
