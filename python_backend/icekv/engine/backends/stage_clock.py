"""Stage times of a step (selection, transfer, attention) that mean the same on a GPU as on a CPU.

On a CPU a stage's time is the wall time between its boundaries. A GPU runs kernels
asynchronously: a wall time would show only their launch, and the wait would land in whichever
stage synchronises next. On CUDA each boundary records an event on the current stream instead (no
synchronisation, so the step runs as fast as when nobody times it), and the elapsed times between
events are added once the step's work is done (:meth:`StageClock.settle`, after the step's
logits came back to the host): host work between two boundaries shows up too, as the stream waits.
"""

from __future__ import annotations

import time

import torch


class StageClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []

    def mark(self):
        """A stage boundary: a wall time, or a CUDA event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, timings: dict, key: str, start, end) -> None:
        """Add the time from ``start`` to ``end`` (two marks) to ``timings[key]`` (on CUDA at :meth:`settle`)."""
        if self.cuda:
            self._pending.append((key, start, end))
        else:
            timings[key] += end - start

    def settle(self, timings: dict) -> None:
        """Add the CUDA stages' times once their events have passed (a no-op on a CPU)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for key, start, end in self._pending:
            timings[key] += start.elapsed_time(end) / 1e3
        self._pending.clear()
