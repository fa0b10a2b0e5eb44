#!/usr/bin/env bash
# kvpress (NVIDIA's KV-compression library, PyPI `kvpress`) on an `icekv eval` grid, in an environment
# of its own (.venv-kvpress: kvpress pins transformers < 5.3 and numpy 2, icekv's .venv neither), made
# here on first use. Arguments go to bench/kvpress_reference.py, e.g.
#   bash bench/kvpress_reference.sh --model ~/.cache/icekv/models/SmolLM2-135M-Instruct --task niah_single \
#     --lengths 3000 --samples 8 --budgets 128,256,512,1024 --press snapkv --window 32 --out bench/results/X
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-kvpress
PYTHON=$(/usr/bin/python3.11 -c "import venv" 2>/dev/null && echo /usr/bin/python3.11 || echo python3)
if [ ! -f "$VENV/.installed" ]; then
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q torch==2.13.0 "transformers<5.3" kvpress==0.5.5 \
    numba==0.68.1
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
  touch "$VENV/.installed"
fi
exec "$VENV/bin/python" bench/kvpress_reference.py "$@"
