import pytest

from icekv.config import EngineConfig, PagingConfig, SamplingConfig
from icekv.errors import ConfigError


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: PagingConfig(page_size=12), "page_size"),
        (lambda: PagingConfig(page_size=0), "page_size"),
        (lambda: PagingConfig(page_size=16, max_context_tokens=8), "max_context_tokens"),
        (lambda: SamplingConfig(max_tokens=0), "max_tokens"),
        (lambda: SamplingConfig(temperature=-1), "temperature"),
        (lambda: SamplingConfig(top_p=0), "top_p"),
        (lambda: EngineConfig(dtype="int8"), "dtype"),
        (lambda: EngineConfig(prefill_chunk_tokens=0), "prefill_chunk_tokens"),
        (lambda: EngineConfig(index_threads=-1), "index_threads"),
    ],
)
def test_bad_settings_name_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_pool_pages_round_up():
    assert PagingConfig(page_size=16, max_context_tokens=33).num_pages == 3
