"""Registration of icekv::page_select and icekv::sparse_paged_attention with TensorRT's Python
plugin API (``tensorrt.plugin``). The AOT implementations return PTX compiled from the icekv
kernels, so a built engine runs them without Python.

Written against TensorRT 10.x's ``tensorrt.plugin`` (register / aot_impl, KernelLaunchParams,
SymIntExprs). Not executed on the machines this project is developed on (no TensorRT there):
see plugins/README.md for what was verified where.
"""

import functools
from typing import Tuple

from icekv.trt.spec import PLUGIN_NAMESPACE, DecodeStepSpec, plugin_grid


@functools.cache
def register_plugins(spec: DecodeStepSpec) -> tuple[str, str]:
    """Register both plugins for ``spec`` (once per process); returns their ids."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from icekv.kernels import aot

    kernels = {name: aot.compile_kernel(s, arch=spec.arch) for name, s in spec.kernel_specs().items()}
    select_id, attend_id = f"{PLUGIN_NAMESPACE}::page_select", f"{PLUGIN_NAMESPACE}::sparse_paged_attention"

    def launch_params(batch, kernel):
        grid_x, grid_y, grid_z = plugin_grid(batch, spec.num_kv_heads)
        return trtp.KernelLaunchParams(grid_x=grid_x, grid_y=grid_y, grid_z=grid_z,
                                       block_x=kernel.threads_per_block, shared_mem=kernel.shared_mem)

    @trtp.register(select_id)
    def select_desc(q: trtp.TensorDesc, index_k: trtp.TensorDesc, cand_ids: trtp.TensorDesc,
                    cand_lens: trtp.TensorDesc, top_k: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        b, hkv, c = q.shape_expr[0], index_k.shape_expr[0], cand_ids.shape_expr[2]
        ids = trtp.from_shape_expr((b, hkv, top_k), dtype=trt.int32)
        return ids, ids.like(), trtp.from_shape_expr((b, hkv, c), dtype=trt.float32)

    @trtp.aot_impl(select_id)
    def select_aot(q: trtp.TensorDesc, index_k: trtp.TensorDesc, cand_ids: trtp.TensorDesc,
                   cand_lens: trtp.TensorDesc, top_k: int, outputs: Tuple[trtp.TensorDesc], tactic: int):
        kernel = kernels["page_select"]
        extra = trtp.SymIntExprs(3)  # n_cand, n_slots, k
        extra[0] = trtp.SymInt32(cand_ids.shape_expr[2])
        extra[1] = trtp.SymInt32(index_k.shape_expr[1])
        extra[2] = trtp.SymInt32(top_k)
        return kernel.name, kernel.ptx, launch_params(q.shape_expr[0], kernel), extra

    @trtp.register(attend_id)
    def attend_desc(q: trtp.TensorDesc, k_slots: trtp.TensorDesc, v_slots: trtp.TensorDesc,
                    slot_ids: trtp.TensorDesc, slot_lens: trtp.TensorDesc) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        lse = trtp.from_shape_expr((q.shape_expr[0], q.shape_expr[1]), dtype=trt.float32)
        return q.like(), lse

    @trtp.aot_impl(attend_id)
    def attend_aot(q: trtp.TensorDesc, k_slots: trtp.TensorDesc, v_slots: trtp.TensorDesc,
                   slot_ids: trtp.TensorDesc, slot_lens: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int):
        kernel = kernels["sparse_paged_attention"]
        extra = trtp.SymIntExprs(2)  # n_sel, n_slots
        extra[0] = trtp.SymInt32(slot_ids.shape_expr[2])
        extra[1] = trtp.SymInt32(k_slots.shape_expr[1])
        return kernel.name, kernel.ptx, launch_params(q.shape_expr[0], kernel), extra

    return select_id, attend_id
