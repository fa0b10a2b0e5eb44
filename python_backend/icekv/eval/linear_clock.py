"""Time a decode spends in the model's linear layers (the weights it reads), for the decode
bench's split of a token's time: forward hooks on every linear layer, plain or stored narrower,
summing the wall time between each one's start and end. CPU only: on a GPU a layer's call returns
before its kernel ends. The hooks add a few microseconds per layer call to the step they time."""

from __future__ import annotations

import time

from torch import nn

from icekv.model.weights import WeightOnlyLinear


class LinearClock:
    """Used as a context manager around the steps to time; ``seconds`` is their linear layers' total."""

    def __init__(self, model: nn.Module):
        self.model, self.seconds, self._handles, self._started = model, 0.0, [], 0.0

    def __enter__(self) -> "LinearClock":
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, WeightOnlyLinear)):
                self._handles += [module.register_forward_pre_hook(self._start),
                                  module.register_forward_hook(self._stop)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _start(self, module, args) -> None:
        self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._started
