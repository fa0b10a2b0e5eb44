"""Stage times: wall time on a CPU; on CUDA, events read after the step (the work itself, not its launch)."""

import time

import pytest
import torch

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.engine.backends.stage_clock import StageClock


def test_on_a_cpu_a_stage_is_its_wall_time():
    clock, timings = StageClock(torch.device("cpu")), {"select_s": 0.0}
    t0 = clock.mark()
    time.sleep(0.01)
    clock.add(timings, "select_s", t0, clock.mark())
    assert timings["select_s"] >= 0.01
    clock.settle(timings)  # nothing pending on a CPU
    assert timings["select_s"] < 1.0


@pytest.mark.gpu
def test_on_cuda_a_stage_counts_its_kernels_not_their_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    clock, timings = StageClock(torch.device("cuda")), {"attention_s": 0.0}
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = clock.mark()
    for _ in range(20):
        a = a @ a / 64
    clock.add(timings, "attention_s", t0, clock.mark())
    assert timings["attention_s"] == 0.0  # pending until the step's work is done
    clock.settle(timings)
    assert timings["attention_s"] > 0


def test_a_sparse_decode_split_is_settled_after_every_step():
    engine = Engine(EngineConfig(random_weights="llama-tiny", device="cpu", paging=PagingConfig(pool_tokens=2048)))
    sel = SelectionConfig(policy="icecache", budget=64)
    seq = engine.submit([3 + i % 500 for i in range(700)], SamplingConfig(max_tokens=4, ignore_eos=True), sel)
    while not seq.decoder_ready and not seq.done:
        engine.step()
    engine.step()
    timings = seq.backend.timings
    assert timings["select_s"] > 0 and timings["attention_s"] > 0 and not seq.backend.clock._pending
    engine.run(seq)
