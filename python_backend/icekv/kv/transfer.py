"""Host-to-device page copies through one pinned staging buffer, on a side stream.

The selected pages of a layer are gathered on the host into :meth:`StagedTransfer.staging`, then
:meth:`StagedTransfer.to_device` issues one bulk copy of the whole buffer. On a GPU the copy runs
on a side stream and the compute stream waits for it with an event (not the host), so the host is
free to select and gather the next layer's pages meanwhile; the buffer is refilled only once the
copy out of it has finished. On a CPU the buffer is the destination itself: the same calls, no
stream, no event. :class:`CudaCopySync` is the one CUDA-only part.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class CopySync(Protocol):
    """What ordering the copies needs from the device: a side stream, events, waits."""

    def copy_on_side_stream(self, staged: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``staged`` copied to ``device`` on the side stream, asynchronously."""
        ...

    def record(self):
        """An event marking the end of the copies issued so far on the side stream."""
        ...

    def compute_waits(self, event, out: torch.Tensor) -> None:
        """Make the compute stream wait for ``event`` before it reads ``out``."""
        ...


class CudaCopySync:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy_on_side_stream(self, staged, device):
        # needs nothing queued on the compute stream: it reads the host buffer and writes memory of
        # its own (held for the compute stream by record_stream), so it may run during that work
        with torch.cuda.stream(self.stream):
            return staged.to(device, non_blocking=True)

    def record(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def compute_waits(self, event, out):
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        out.record_stream(compute)  # its memory was allocated on the side stream


class StagedTransfer:
    """One layer's staging buffer and its copies to ``device`` (a ``sync`` stand-in for tests)."""

    def __init__(self, device: str | torch.device, dtype: torch.dtype, sync: CopySync | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.sync = sync if sync is not None else (CudaCopySync(self.device) if self.device.type == "cuda" else None)
        self.buffer = torch.empty(0, dtype=dtype)
        self.copied = None  # the event of the last copy out of the buffer, until it is known done

    def staging(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` to gather into (pinned when copying to a GPU);
        first waits for the previous copy out of the buffer to finish."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        n = math.prod(shape)
        if self.buffer.numel() < n:
            self.buffer = torch.empty(max(n, 2 * self.buffer.numel()), dtype=self.dtype,
                                      pin_memory=self.sync is not None and self.device.type == "cuda")
        return self.buffer[:n].view(shape)

    def to_device(self, staged: torch.Tensor) -> torch.Tensor:
        """``staged`` (from :meth:`staging`) on the device, ordered before the compute stream's
        next reads; on a CPU, ``staged`` itself."""
        if self.sync is None:
            return staged.to(self.device)
        out = self.sync.copy_on_side_stream(staged, self.device)
        self.copied = self.sync.record()
        self.sync.compute_waits(self.copied, out)
        return out
