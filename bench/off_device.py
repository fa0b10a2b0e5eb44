"""Run the icekv command line on a CPU with each pool placed as a GPU run places it: the GPU
check's dry run (bench/gpu_check.sh --dry-run).

On a GPU, ``bench decode | batch`` time full attention with its pool on the device and a sparse
policy with its pool in host memory, where attention reads per request, layers attended whole
through a compute mirror and selected pages staged then loaded. On a CPU host and device are one
memory, so the engine would read every pool in place. Here each engine whose pool setting is
``host`` declares its pool off the compute device, as tests/engine/test_pool_off_device.py does,
and the benches group their policies by placement as on a GPU: the dry run goes through the code
paths the GPU run takes.

    python bench/off_device.py bench decode --device cpu --random-weights llama-tiny ...
"""

from __future__ import annotations

import sys

import icekv.engine.engine as engine_module
from icekv.cli import bench, main
from icekv.kv import PagedKVCache

_placements: list[str] = []
_pool_device = engine_module.pool_device
_cache_init = PagedKVCache.__init__
_pool_groups = bench._pool_groups


def _noting_pool_device(kv_pool, compute):
    _placements.append(kv_pool)  # the engine builds its cache right after asking
    return _pool_device(kv_pool, compute)


def _declaring_init(self, *args, **kwargs):
    _cache_init(self, *args, **kwargs)
    self.declared_off_compute = bool(_placements) and _placements[-1] == "host"
    _placements.clear()


engine_module.pool_device = _noting_pool_device
PagedKVCache.__init__ = _declaring_init
PagedKVCache.pool_on_compute = property(
    lambda self: not getattr(self, "declared_off_compute", False) and self.pool.device == self.compute)
bench._pool_groups = lambda policies, settings, device_type: _pool_groups(policies, settings, "cuda")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
