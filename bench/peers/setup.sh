#!/usr/bin/env bash
# The peers' environments, never the project's: vLLM's CPU build in .venv-vllm (`make setup-vllm`,
# which the plugin's tests use too) and llama.cpp through llama-cpp-python in .venv-llamacpp (built
# from its source distribution for this machine's CPU, with the gguf package beside it).
#
#   bash bench/peers/setup.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
LLAMACPP_PIN="llama-cpp-python==0.3.36"
make setup-vllm
if ! .venv-llamacpp/bin/python -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv .venv-llamacpp
    .venv-llamacpp/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-llamacpp/bin/python -m pip install --disable-pip-version-check -q \
        "$LLAMACPP_PIN" "$(grep '^gguf==' requirements.txt)"
fi
.venv-llamacpp/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
