"""icekv inside vLLM: IceCache (or any icekv decode method whose selector sees only keys) as vLLM's
CPU attention backend, over vLLM's own paged KV cache.

vLLM keeps its scheduler, batching, prefix caching, OpenAI server and kernels; prefill, short
contexts and every request icekv does not select for run vLLM's own attention. Installed with the
``vllm`` extra in an environment of its own (vLLM's CPU build needs numpy 2). vLLM imports this
package only through the entry point (:func:`register`); nothing here imports vLLM at import time.

Use: ``python -m vllm.entrypoints.openai.api_server --model DIR --block-size 32
--worker-cls icekv.vllm.worker.IceKVCPUWorker --additional-config '{"icekv": {"policy":
"icecache", "budget": 256}}'``; a request may set ``policy`` and ``budget`` in ``vllm_xargs``.
"""


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point, called once in each vLLM process: icekv's
    backend takes the place of vLLM's CPU attention (the CPU platform always picks that one; icekv's
    passes every layer through to it unless the server's ``icekv`` settings ask for a method)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "icekv.vllm.backend.IceKVCPUBackend")
