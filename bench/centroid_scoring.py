"""Time one layer's IceCache centroids search three ways: all on the host (the compiled search
reads every centroid and rescores the candidates); the centroids ranked on the compute device
(DeviceCentroids + select_pages) and the candidates rescored on the host; and both on the device
(DeviceRescoring: the candidates' keys cached there). How often each picks the host's pages.

Llama-3.1-8B head shapes (8 KV heads, 4 query heads each, head_dim 128), pages of 16 full tokens,
k pages per KV head, the served rule's candidates, the index's page keys in fp32 and int8; the
device copies in --dtype. Random keys and queries: the time does not depend on their values, but the
union of the query heads' candidates (what is rescored) is near its largest, as it is for a
random-weight model; the records say how many pages that was. Rescoring on the device is timed
warm (the same query again: every candidate's keys already there, the bound a steady decode
approaches) and cold (a new query each call: nearly every candidate copied, as a random-weight
model decodes); bench/candidate_reuse.py measures where a real model lies between the two. The
store is filled directly (no tree build): the search reads pages, not the tree. Multiply by the
sparse layers (30 of 32) for a token's search time.

    python bench/centroid_scoring.py --device cuda --contexts 32768,131072 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def store_of(tokens: int, heads: int, dim: int, page: int, score_dtype: torch.dtype = torch.float32, seed: int = 0):
    """A PageStore with ``tokens // page`` full pages of random keys per head."""
    from icekv.index import PageStore

    pages = tokens // page
    g = torch.Generator().manual_seed(seed)
    store = PageStore(heads, page, dim, score_dtype)
    store.reserve(pages)
    present = torch.ones(pages, page, dtype=torch.bool)
    for h in range(heads):
        store.write(h, torch.arange(pages), torch.randn(pages, page, dim, generator=g), present)
    store.tokens[:, :pages] = torch.arange(pages * page).view(pages, page)  # members: local token ids
    store.num_pages[:] = pages
    return store


def median_s(fn, device: torch.device, repeats: int) -> float:
    from icekv.devices import synchronize

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_context(tokens: int, device: torch.device, dtype: torch.dtype, k: int, repeats: int, score_dtype: str,
                  heads: int = 8, group: int = 4, dim: int = 128, page: int = 16) -> dict:
    from icekv.methods.icecache import IceCacheConfig
    from icekv.index.device_centroids import DeviceCentroids
    from icekv.index.device_rescoring import DeviceRescoring
    from icekv.index.fused_search import candidate_search, centroid_search, union_of_picks

    store = store_of(tokens, heads, dim, page, getattr(torch, score_dtype))
    config = IceCacheConfig()
    candidates, by_score = config.candidates(k), config.merges_by_score
    t0 = time.perf_counter()
    centroids = DeviceCentroids(store, device, dtype)
    copy_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    queries = [torch.randn(heads, group, dim, generator=g).to(device, dtype) for _ in range(repeats + 4)]  # [H, G, D]
    q_dev, *others = queries
    rescoring = DeviceRescoring(store, device, dtype, group * candidates)
    fresh = iter(range(len(others)))  # each cold call a query of its own

    host = lambda: centroid_search(store, q_dev.cpu().float(), candidates, k, by_score=by_score)  # noqa: E731
    ranked = lambda q=q_dev: centroids.candidates(q, candidates)  # noqa: E731
    on_device = lambda: candidate_search(store, q_dev.cpu().float(), ranked().cpu().numpy(), k, by_score=by_score)  # noqa: E731
    rescored = lambda q=q_dev: rescoring.search(q, ranked(q).cpu().numpy(), k, by_score=by_score)  # noqa: E731
    cold = lambda: rescored(others[next(fresh)])  # noqa: E731
    picks_host, picks_device, picks_rescored = host(), on_device(), rescored()

    def same(picks) -> float:
        """Share of the host search's (head, page) picks that ``picks`` has too."""
        pairs = lambda p: set(zip(p[0].tolist(), p[1].tolist()))  # noqa: E731
        return len(pairs(picks_host) & pairs(picks)) / max(len(picks_host[0]), 1)

    _, n_rescored = union_of_picks(ranked().cpu().numpy().astype("int64"))  # [H] pages rescored per head
    warm_s = median_s(rescored, device, repeats)
    moved = rescoring.bytes_moved
    cold_s = median_s(cold, device, repeats)
    return {
        "context": tokens, "score_dtype": score_dtype, "pages_per_head": tokens // page, "k": k,
        "candidates": candidates, "rescored_per_head": float(n_rescored.mean()),
        "host_s": median_s(host, device, repeats), "device_s": median_s(on_device, device, repeats),
        "device_ranking_s": median_s(ranked, device, repeats), "device_copy_bytes": centroids.nbytes,
        "device_rescoring_warm_s": warm_s, "device_rescoring_cold_s": cold_s,
        "device_rescoring_bytes": rescoring.nbytes,
        "cold_bytes_copied_per_call": (rescoring.bytes_moved - moved) / (repeats + 3),
        "first_copy_s": copy_s, "same_pages": same(picks_device), "same_pages_rescored": same(picks_rescored),
    }


def main() -> int:
    from icekv.devices import resolve_device

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="the device copy's dtype (default: bfloat16 on a GPU)")
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--k", type=int, default=12, help="pages selected per KV head")
    parser.add_argument("--score-dtypes", default="float32,int8", help="the index's page keys (what the host rescores)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    records = []
    for tokens in (int(x) for x in args.contexts.split(",")):
        for score_dtype in args.score_dtypes.split(","):
            r = bench_context(tokens, device, dtype, args.k, args.repeats, score_dtype)
            records.append(r)
            print(f"{tokens:>7} tokens, {score_dtype} keys: host {r['host_s'] * 1e3:7.3f} ms, device+host "
                  f"{r['device_s'] * 1e3:7.3f} ms (ranking {r['device_ranking_s'] * 1e3:.3f} ms), device+device "
                  f"warm {r['device_rescoring_warm_s'] * 1e3:.3f} ms, "
                  f"cold {r['device_rescoring_cold_s'] * 1e3:.3f} ms; "
                  f"{r['rescored_per_head']:.0f} pages rescored per head, same pages {r['same_pages']:.0%} / "
                  f"{r['same_pages_rescored']:.0%}", flush=True)
    meta = {"command": "python " + " ".join(sys.argv), "device": str(device), "dtype": str(dtype),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "machine": f"{platform.machine()}, torch threads {torch.get_num_threads()}"}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
