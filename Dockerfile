# icekv on NVIDIA's Triton Inference Server image.
# Status: a starting point, NOT built or run yet (no Docker engine on our development machines).
# The deployment work (model repository, non-root user, probes) will complete and check it.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/icekv
COPY requirements.txt pyproject.toml README.md ./
COPY python_backend ./python_backend
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir "numpy<2" "safetensors>=0.4" "tokenizers>=0.20" "tqdm>=4.60"

# The model is fetched into ICEKV_CACHE (mount a volume there) by `icekv fetch`; no hub access.
ENV ICEKV_CACHE=/var/cache/icekv
ENTRYPOINT ["icekv"]
