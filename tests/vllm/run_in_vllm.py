"""Run by the plugin's tests under the vLLM environment (.venv-vllm): one vLLM engine with icekv's
plugin on MODEL, the cases of tests/vllm/test_vllm_plugin.py, their tokens and icekv's state as one
JSON object on one line of stdout (the only one starting with "{").

The cache holds 64 blocks of 32 tokens (vLLM keeps one back): two requests of 960 + LONG_NEW_TOKENS
tokens fit on admission (30 blocks each) and outgrow it at their 33rd token, so vLLM preempts one."""

import json
import os
import sys

CACHE_BLOCKS, BLOCK_SIZE = 64, 32
LONG_NEW_TOKENS = 48  # the long requests' answers: past the 33rd token, where one is preempted


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: sized by this, not by free memory
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, max_model_len=1536, enforce_eager=True, seed=0,
              num_gpu_blocks_override=CACHE_BLOCKS, worker_cls="icekv.vllm.worker.IceKVCPUWorker",
              enable_prefix_caching=True, additional_config={"icekv": {"policy": "icecache", "budget": 128}})

    def params(xargs=None, max_tokens=16):
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=xargs)

    def generate(ids_list, xargs=None, max_tokens=16):
        return [o.outputs[0].token_ids for o in llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids_list],
                                                              params(xargs, max_tokens), use_tqdm=False)]

    def stats():
        """icekv's state after one more step (in which the worker hears of the requests that just ended)."""
        llm.generate([TokensPrompt(prompt_token_ids=prompts["short"][0][:8])], params(max_tokens=1), use_tqdm=False)
        return llm.collective_rpc("icekv_stats")[0]

    first, *others = prompts["short"]
    out = {"backend": AttentionBackendEnum.CPU_ATTN.get_path(),
           "full": generate([first], {"policy": "full"})[0],
           "icecache": generate([first])[0],
           "quest": generate([first], {"policy": "quest", "budget": 128})[0],
           "wide": generate([first], {"budget": 4096})[0],
           "batched": generate(prompts["short"]),
           "alone": [generate([p])[0] for p in others],
           "stats": [stats()],
           "refused": refused(llm, params, TokensPrompt, first),
           "layouts": layouts()}
    # before the long requests evict the short ones' blocks from the cache
    for xargs in (None, {"policy": "quest", "budget": 128}):  # their indexes, kept last: not the first to go
        generate([first], xargs)
    before = stats()
    shared = llm.generate([TokensPrompt(prompt_token_ids=prompts["extended"])], params(), use_tqdm=False)[0]
    quest = generate([prompts["extended"]], {"policy": "quest", "budget": 128})[0]
    out["prefix_hit"] = {"cached": shared.num_cached_tokens, "quest": quest, "before": before, "stats": stats()}
    before = stats()
    together = generate(prompts["long"], max_tokens=LONG_NEW_TOKENS)
    out["preempted"] = {"together": together, "before": before, "stats": stats(),
                        "alone": [generate([p], max_tokens=LONG_NEW_TOKENS)[0] for p in prompts["long"]]}
    out["aborted"] = aborted(llm, params, TokensPrompt(prompt_token_ids=others[0]), stats)
    print(json.dumps(out), flush=True)


def aborted(llm, params, prompt, stats) -> dict:
    """A request aborted while it selects: its index, held while it decodes, released at the next step."""
    engine = llm.llm_engine
    engine.add_request("to-abort", prompt, params(max_tokens=200))
    for _ in range(8):  # its prefill, then decoding steps that select
        engine.step()
    during = llm.collective_rpc("icekv_stats")[0]  # no step: it is still decoding
    engine.abort_request(["to-abort"])
    return {"during": during, "after": stats()}


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


def refused(llm, params, tokens_prompt, ids) -> dict:
    """What vLLM answers requests whose icekv settings icekv cannot run (its error, per case)."""
    out = {}
    for name, xargs in {"unknown policy": {"policy": "magic"}, "budget 0": {"budget": 0},
                        "budget off the page size": {"budget": 100}, "not inside vLLM": {"policy": "snapkv"}}.items():
        try:
            llm.generate([tokens_prompt(prompt_token_ids=ids[:50])], params(xargs, max_tokens=2), use_tqdm=False)
            out[name] = None
        except Exception as e:  # vLLM's validation error
            out[name] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    main()
