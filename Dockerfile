# icekv on NVIDIA's Triton Inference Server image (Triton 2.51, the same server as the
# nvidia-pytriton wheel the tests run on CPU). Not built here: our machines have no Docker engine;
# `make test` lints this file with hadolint and checks it against deploy/ and `icekv serve`.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ARG TORCH_VERSION=2.5.1
# NUMBA_CACHE_DIR: the compiled CPU index kernels, kept with the model (compiled for the CPU they
# run on, on the first start)
ENV ICEKV_CACHE=/var/cache/icekv \
    NUMBA_CACHE_DIR=/var/cache/icekv/numba \
    PYTHONUNBUFFERED=1

RUN groupadd --gid 1000 icekv \
 && useradd --uid 1000 --gid icekv --create-home --shell /usr/sbin/nologin icekv

WORKDIR /opt/icekv
COPY pyproject.toml README.md ./
COPY python_backend ./python_backend
COPY model_repository ./model_repository

# torch first (CUDA build matching the image), then icekv with its serving, store, KV-events and converter extras
# (DL3013: "." is this project; its dependency ranges are in pyproject.toml).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir ".[serve,store,kv-events,convert]" \
 && mkdir -p "${ICEKV_CACHE}" \
 && chown icekv:icekv "${ICEKV_CACHE}"

USER 1000:1000
EXPOSE 8000 8001 8002 9000
# The model is not baked in: mount it (ICEKV_MODEL_DIR / --model) or run `icekv fetch --what model`
# into the ICEKV_CACHE volume first (an init container in deploy/base/deployment.yaml).
ENTRYPOINT ["icekv"]
CMD ["serve", "--host=0.0.0.0", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--openai-port=9000"]
