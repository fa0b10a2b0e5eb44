from icekv.config.settings import serving_config
import pytest

import torch

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.config.serving import ServingConfig
from icekv.devices import pool_device, resolve_device
from icekv.errors import ConfigError


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: PagingConfig(page_size=12), "page_size"),
        (lambda: PagingConfig(page_size=0), "page_size"),
        (lambda: PagingConfig(page_size=16, pool_tokens=8), "pool_tokens"),
        (lambda: SamplingConfig(max_tokens=0), "max_tokens"),
        (lambda: SamplingConfig(temperature=-1), "temperature"),
        (lambda: SamplingConfig(top_p=0), "top_p"),
        (lambda: EngineConfig(dtype="int8"), "dtype"),
        (lambda: EngineConfig(prefill_chunk_tokens=0), "prefill_chunk_tokens"),
        (lambda: EngineConfig(index_threads=-1), "index_threads"),
        (lambda: EngineConfig(device="gpu"), "device"),
        (lambda: EngineConfig(device="cuda:x"), "device"),
        (lambda: EngineConfig(kv_pool="disk"), "kv_pool"),
        (lambda: EngineConfig(model_dir="/m", random_weights="llama-tiny"), "random_weights"),
    ],
)
def test_bad_settings_name_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_pool_pages_round_up():
    assert PagingConfig(page_size=16, pool_tokens=33).num_pages == 3


def test_dtype_defaults_by_device_and_an_explicit_one_wins():
    assert EngineConfig().dtype_on("cuda") == "bfloat16" and EngineConfig().dtype_on("cpu") == "float32"
    assert EngineConfig(dtype="float16").dtype_on("cuda") == "float16"


def test_pool_placement_follows_the_default_policy_unless_set():
    assert EngineConfig().pool_placement(sparse_default=False) == "device"  # full attention reads the pool in place
    assert EngineConfig().pool_placement(sparse_default=True) == "host"
    assert EngineConfig(kv_pool="device").pool_placement(sparse_default=True) == "device"
    assert pool_device("host", torch.device("cpu")) == pool_device("device", torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_a_clear_error(spec):
    with pytest.raises(ConfigError, match=f"device '{spec}' needs a CUDA GPU"):
        resolve_device(spec)
    assert resolve_device("auto") == torch.device("cpu")


def test_device_and_kv_pool_are_model_parameters():
    engine = serving_config({"device": "cpu", "kv_pool": "host"}).engine
    assert (engine.device, engine.kv_pool) == ("cpu", "host")
    with pytest.raises(ConfigError, match="device"):
        serving_config({"device": "tpu"})
