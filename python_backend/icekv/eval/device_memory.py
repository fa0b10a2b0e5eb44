"""Device memory a piece of work adds, measured by the device's allocator (None on a CPU, whose
allocations the benches measure as resident memory instead)."""

from __future__ import annotations

import torch

from icekv.devices import synchronize


class DevicePeak:
    """``with DevicePeak(device) as peak: ...`` then ``peak.growth``: the most device bytes held
    during the block beyond those held when it began (the preallocated pool and weights excluded)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.growth: int | None = None

    def __enter__(self) -> "DevicePeak":
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            self.growth = torch.cuda.max_memory_allocated(self.device) - self._start
