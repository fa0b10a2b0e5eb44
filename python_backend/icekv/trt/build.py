"""Build the select and attend engines of the decode step with TensorRT's network API (strongly
typed, dynamic batch / candidates / slots with one optimisation profile), or - without TensorRT -
write the kernels' PTX and launch facts that those plugins embed."""

import json
from pathlib import Path

from icekv.kernels import aot
from icekv.trt.spec import DecodeStepSpec


def tensorrt_unavailable() -> str | None:
    """Why TensorRT cannot be used here, or None when it imports."""
    try:
        import tensorrt  # noqa: F401
        import tensorrt.plugin  # noqa: F401
    except Exception as e:  # a missing package, or bindings without libnvinfer
        return f"tensorrt does not import ({type(e).__name__}: {e})"
    return None


def write_kernels(spec: DecodeStepSpec, out_dir: str | Path) -> Path:
    """PTX of every kernel the engines embed, for ``sm_<arch>``; returns kernels.json."""
    compiled = {name: aot.compile_kernel(s, arch=spec.arch) for name, s in spec.kernel_specs().items()}
    return aot.write_artifacts(compiled, out_dir)


def build_engines(spec: DecodeStepSpec, out_dir: str | Path, workspace_mib: int = 1024) -> dict[str, Path]:
    """``select.engine`` and ``attend.engine`` (plus ``spec.json``) under ``out_dir``."""
    import tensorrt as trt

    from icekv.trt.plugins import register_plugins

    register_plugins(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    dt = {"float16": trt.float16, "bfloat16": trt.bfloat16, "float32": trt.float32}[spec.dtype]
    hq, hkv, d, p = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.page_size
    k_max = spec.max_slots

    def build(name, inputs, make_outputs):
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        profile = builder.create_optimization_profile()
        tensors = []
        for tname, dtype, (lo, opt, hi) in inputs:
            tensors.append(network.add_input(tname, dtype, tuple(-1 if a != b else a for a, b in zip(lo, hi))))
            profile.set_shape(tname, lo, opt, hi)
        for i, t in enumerate(make_outputs(network, tensors)):
            t.name = f"{name}_out{i}"
            network.mark_output(t)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
        config.add_optimization_profile(profile)
        blob = builder.build_serialized_network(network, config)
        if blob is None:
            raise RuntimeError(f"TensorRT could not build the {name} engine (see its log above)")
        path = out / f"{name}.engine"
        path.write_bytes(bytes(blob))
        return path

    b, c = spec.max_batch, spec.max_candidates
    q = ("q", dt, ((1, hq, d), (1, hq, d), (b, hq, d)))

    def select_outputs(network, t):
        layer = network.add_plugin(trt.plugin.op.icekv.page_select(*t, top_k=spec.top_k), aot=True)
        return [layer.get_output(i) for i in range(3)]

    def attend_outputs(network, t):
        layer = network.add_plugin(trt.plugin.op.icekv.sparse_paged_attention(*t), aot=True)
        return [layer.get_output(i) for i in range(2)]

    paths = {
        "select": build("select", [
            q, ("index_k", dt, ((hkv, 1, p, d), (hkv, c // 2 or 1, p, d), (hkv, c, p, d))),
            ("cand_ids", trt.int32, ((1, hkv, 1), (1, hkv, c // 2 or 1), (b, hkv, c))),
            ("cand_lens", trt.int32, ((1, hkv, 1), (1, hkv, c // 2 or 1), (b, hkv, c))),
        ], select_outputs),
        "attend": build("attend", [
            q, ("k_slots", dt, ((hkv, 1, p, d), (hkv, k_max * b, p, d), (hkv, k_max * b, p, d))),
            ("v_slots", dt, ((hkv, 1, p, d), (hkv, k_max * b, p, d), (hkv, k_max * b, p, d))),
            ("slot_ids", trt.int32, ((1, hkv, 1), (1, hkv, k_max), (b, hkv, k_max))),
            ("slot_lens", trt.int32, ((1, hkv, 1), (1, hkv, k_max), (b, hkv, k_max))),
        ], attend_outputs),
    }
    (out / "spec.json").write_text(json.dumps(spec.__dict__, indent=2) + "\n")
    return paths
