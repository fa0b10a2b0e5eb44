"""Where the engine computes: the ``device`` setting resolved against the machine.

``auto`` is the first CUDA device when torch sees one, else the CPU. The KV page pool lives on the
host (pinned when the compute device is a GPU) or on the compute device (:func:`pool_device`).
"""

from __future__ import annotations

import os

import torch

from icekv.errors import ConfigError


HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # PyTorch's switch: large CPU tensors on transparent huge pages


def use_huge_pages() -> None:
    """Back torch's large CPU tensors (2 MiB and up) with transparent huge pages, unless the
    environment says otherwise (``THP_MEM_ALLOC_ENABLE=0``).

    Prefill attention and compression scoring allocate temporaries of hundreds of MiB per layer;
    each fresh allocation is mapped anew and faulted in 4 KiB at a time, and in a long compression
    those faults can cost more kernel time than the arithmetic. Huge pages take 512x fewer faults.
    PyTorch reads the setting at its first allocation, so a process's entry point calls this
    before it makes a tensor (the CLI, the Triton model's initialize)."""
    os.environ.setdefault(HUGE_PAGES, "1")


def huge_pages_setting() -> str:
    """``THP_MEM_ALLOC_ENABLE=<value>`` as this process runs, for results' machine line."""
    return f"{HUGE_PAGES}={os.environ.get(HUGE_PAGES, '0')}"


def resolve_device(spec: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> the torch device; a ConfigError naming the
    setting when it asks for a GPU this machine does not have."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {spec!r} needs a CUDA GPU, but torch sees none "
                              f"(torch {torch.__version__}); use device 'cpu' or 'auto'")
        if (device.index or 0) >= count:
            raise ConfigError(f"device {spec!r}: this machine has {count} CUDA device(s)")
        device = torch.device("cuda", device.index or 0)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; a CPU has none queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pool_device(kv_pool: str, compute: torch.device) -> torch.device:
    """The page pool's device: the compute device, or the host for ``kv_pool='host'``."""
    return compute if kv_pool == "device" else torch.device("cpu")
