"""Run by the plugin's tests under the vLLM environment (.venv-vllm): one vLLM engine with icekv's
plugin on MODEL, the cases of tests/vllm/test_vllm_plugin.py, their tokens and icekv's state as one
JSON object on one line of stdout (the only one starting with "{")."""

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: sized by this, not by free memory
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, dtype="float32", block_size=32, max_model_len=4096, enforce_eager=True, seed=0,
              worker_cls="icekv.vllm.worker.IceKVCPUWorker", enable_prefix_caching=True,
              additional_config={"icekv": {"policy": "icecache", "budget": 128}})

    def generate(ids_list, xargs=None, max_tokens=16):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=xargs)
        return [o.outputs[0].token_ids for o in llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids_list],
                                                              params, use_tqdm=False)]

    first = prompts[0]
    out = {"backend": AttentionBackendEnum.CPU_ATTN.get_path(),
           "full": generate([first], {"policy": "full"})[0],
           "icecache": generate([first])[0],
           "quest": generate([first], {"policy": "quest", "budget": 128})[0],
           "wide": generate([first], {"budget": 4096})[0],
           "batched": generate(prompts),
           "alone": [generate([p])[0] for p in prompts[1:]],
           "stats": llm.collective_rpc("icekv_stats"),
           "refused": refused(llm, SamplingParams, TokensPrompt, first),
           "layouts": layouts()}
    print(json.dumps(out), flush=True)


def layouts() -> dict:
    """Rows written by vLLM's own cache writer, read back through icekv's probed layout, per ISA."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from icekv.vllm.backend import probe_layout
    from icekv.vllm.request_index import BlockRows

    out = {}
    for dtype, block, dim in ((torch.float32, 32, 64), (torch.bfloat16, 32, 64), (torch.bfloat16, 128, 128),
                              (torch.bfloat16, 32, 80)):
        isa = _get_attn_isa(dtype, block, dim)
        heads, tokens = 3, 3 * block - 5
        cache = torch.zeros(5, heads, block, 2 * dim, dtype=dtype)
        keys, values = cache.view(5, heads, 2 * block, dim).chunk(2, dim=2)
        k, v = torch.randn(tokens, heads, dim).to(dtype), torch.randn(tokens, heads, dim).to(dtype)
        table = torch.tensor([3, 0, 4], dtype=torch.int32)
        slots = torch.tensor([int(table[t // block]) * block + t % block for t in range(tokens)])
        ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        positions = torch.randint(0, tokens, (heads, 11), generator=torch.Generator().manual_seed(0))
        got_k, got_v = BlockRows(cache, table, probe_layout(isa, dtype, block, dim)).gather(positions)
        out[f"{dtype} block {block} dim {dim} ({isa})"] = all(
            torch.equal(got_k[h], k[positions[h], h]) and torch.equal(got_v[h], v[positions[h], h]) for h in range(heads))
    return out


def refused(llm, sampling_params, tokens_prompt, ids) -> dict:
    """What vLLM answers requests whose icekv settings icekv cannot run (its error, per case)."""
    out = {}
    for name, xargs in {"unknown policy": {"policy": "magic"}, "budget 0": {"budget": 0},
                        "budget off the page size": {"budget": 100}, "not inside vLLM": {"policy": "snapkv"}}.items():
        try:
            llm.generate([tokens_prompt(prompt_token_ids=ids[:50])], sampling_params(max_tokens=2, extra_args=xargs),
                         use_tqdm=False)
            out[name] = None
        except Exception as e:  # vLLM's validation error
            out[name] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    main()
