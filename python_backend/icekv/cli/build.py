"""``icekv build``: TensorRT engines of the decode step with the icekv plugins, or (``--ptx-only``,
no TensorRT or GPU needed) the PTX those plugins embed."""

from __future__ import annotations

import json
from pathlib import Path

from icekv.errors import IcekvError


def _cmd_build(args) -> int:
    from icekv.config.paging import PagingConfig
    from icekv.config.selection import SelectionConfig
    from icekv.engine.model_dir import resolve_model_dir
    from icekv.model import ModelArgs
    from icekv.policies import resolve
    from icekv.trt.build import build_engines, tensorrt_unavailable, write_kernels
    from icekv.trt.spec import DecodeStepSpec

    model_args = ModelArgs.from_dir(resolve_model_dir(args.model))
    overrides = {k: v for k, v in (("num_heads", args.num_heads), ("num_kv_heads", args.num_kv_heads),
                                   ("head_dim", args.head_dim)) if v is not None}
    try:
        paging = PagingConfig(page_size=args.page_size, pool_tokens=args.max_context)
        # the budget's pages checked for the policy, before anything is built
        plan = resolve(SelectionConfig(policy="icecache", budget=args.budget, page_size=args.page_size))
        spec = DecodeStepSpec.from_plan(plan, paging, model_args, dtype=args.dtype, max_batch=args.max_batch,
                                        arch=args.arch, **overrides)
    except ValueError as e:  # ConfigError included: names the offending value
        raise IcekvError(str(e)) from None
    out = Path(args.out)
    if args.ptx_only:
        manifest = write_kernels(spec, out)
        print(json.dumps({"kernels": str(manifest), **{k: str(out / f"{k}.ptx") for k in spec.kernel_specs()}}))
        return 0
    reason = tensorrt_unavailable()
    if reason:
        raise IcekvError(f"cannot build engines: {reason}; --ptx-only writes the plugins' kernels without TensorRT")
    paths = build_engines(spec, out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0
