"""The staged host-to-device copy: real copies on CPU tensors, and its ordering (refill only after
the previous copy finished; compute waits for the copy's event) with a recording stand-in for the
CUDA streams, which this machine lacks."""

import torch

from icekv.kv import DevicePageCache
from icekv.kv.device_cache import TransferPlan
from icekv.kv.transfer import StagedTransfer


class Event:
    def __init__(self, log, n):
        self.log, self.n = log, n

    def synchronize(self):
        self.log.append(("synchronize", self.n))


class RecordingSync:
    """CopySync's calls, logged; the copy itself is a real one."""

    def __init__(self):
        self.log, self.events = [], 0

    def copy_on_side_stream(self, staged, device):
        self.log.append(("copy", staged.data_ptr()))
        return staged.to(device, copy=True)

    def record(self):
        self.events += 1
        self.log.append(("record", self.events))
        return Event(self.log, self.events)

    def compute_waits(self, event, out):
        self.log.append(("compute_waits", event.n))


def test_cpu_copy_is_the_staging_buffer_itself():
    t = StagedTransfer("cpu", torch.float32)
    staged = t.staging((2, 3, 4))
    staged.copy_(torch.arange(24.0).view(2, 3, 4))
    out = t.to_device(staged)
    assert out.data_ptr() == staged.data_ptr() and torch.equal(out, torch.arange(24.0).view(2, 3, 4))
    assert not t.buffer.is_pinned()


def test_staging_grows_and_reuses_one_buffer():
    t = StagedTransfer("cpu", torch.float16)
    a = t.staging((4,))
    b = t.staging((3,))
    assert a.data_ptr() == b.data_ptr()  # reused
    c = t.staging((100,))
    assert c.shape == (100,) and c.is_contiguous() and t.buffer.numel() >= 100 and c.dtype == torch.float16


def test_ordering_compute_waits_for_the_copy_and_refill_waits_for_it_to_finish():
    sync = RecordingSync()
    t = StagedTransfer("cpu", torch.float32, sync=sync)
    first = t.staging((2, 2))
    first.fill_(1.0)
    out = t.to_device(first)
    assert torch.equal(out, torch.ones(2, 2)) and out.data_ptr() != first.data_ptr()  # a real copy
    assert sync.log == [("copy", first.data_ptr()), ("record", 1), ("compute_waits", 1)]
    t.staging((2, 2))  # the next layer's gather: only once the copy out of the buffer is done
    assert sync.log[-1] == ("synchronize", 1)
    t.staging((2, 2))  # already known done: no second wait
    assert sync.log.count(("synchronize", 1)) == 1


def test_device_cache_load_through_a_side_stream_writes_the_same_slots():
    """Slots filled through the recording sync's (real) copy equal slots filled on the CPU path."""
    g = torch.Generator().manual_seed(0)
    pages = torch.randn(2, 3, 4, 8, generator=g)  # [2, n, P, D]
    plan = TransferPlan(torch.tensor([0, 1, 1]), torch.tensor([5, 6, 7]), torch.zeros(3, dtype=torch.long),
                        torch.tensor([0, 0, 1]))
    lengths = torch.tensor([4, 4, 2])
    caches = []
    for sync in (None, RecordingSync()):
        dev = DevicePageCache(2, 2, 4, 8)
        dev._grow(2)
        if sync is not None:
            dev.transfer = StagedTransfer("cpu", torch.float32, sync=sync)
        staging = dev.transfer.staging(tuple(pages.shape))
        staging.copy_(pages)
        dev.load(plan, staging, lengths)
        caches.append(dev)
    for a, b in zip(caches[0].__dict__.items(), caches[1].__dict__.items()):
        if isinstance(a[1], torch.Tensor):
            assert torch.equal(a[1], b[1]), a[0]
    assert torch.equal(caches[0].k[1, 1], pages[0, 2]) and caches[0].bytes_moved == caches[1].bytes_moved
