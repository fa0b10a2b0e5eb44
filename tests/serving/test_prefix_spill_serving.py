"""The prefix cache's spill tier through ``icekv serve``'s model over a real Redis: a conversation's
pages outlive a server restart (and so are shared with any replica over the store); the metrics
count what was written and read back; a setting without a store is refused."""

import pytest

from icekv.errors import ConfigError
from icekv.serving.launcher import TritonServer
from icekv.config.settings import serving_config
from tests.serving.conftest import post, wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]


def _server(redis_url, log) -> TritonServer:
    return TritonServer({"store": redis_url, "prefix_cache_spill": "true", "pool_tokens": "4096",
                         "policy": "full"}, log_path=log)


def test_a_conversation_survives_a_restart_through_redis(redis_url, tmp_path):
    body = {"text_input": "The lighthouse keeper wrote in his log every night. " * 40, "max_tokens": 8}
    first = _server(redis_url, tmp_path / "first.log")
    first.start()
    try:
        status, before = post(first, "/v2/models/icekv/generate", body)
        assert status == 200 and before["cached_tokens"] == 0
    finally:
        first.stop()  # the model's finalize waits for the page writes
    second = _server(redis_url, tmp_path / "second.log")
    second.start()
    try:
        status, after = post(second, "/v2/models/icekv/generate", body)
        assert status == 200 and after["text_output"] == before["text_output"]
        assert after["cached_tokens"] >= before["prompt_tokens"] - 32  # all but the last page(s), from Redis
        m = wait_idle(second)
        assert m["icekv_prefix_cache_reloaded_pages_total"] * 16 == after["cached_tokens"]
        assert m["icekv_prefix_cache_spill_refused_total"] == 0
    finally:
        second.stop()


def test_spilling_needs_a_store_and_the_prefix_cache():
    with pytest.raises(ConfigError, match="prefix_cache_spill needs a store"):
        serving_config({"prefix_cache_spill": "true"})
    with pytest.raises(ConfigError, match="prefix_cache_spill needs the prefix cache"):
        serving_config({"prefix_cache_spill": "true", "store": "/tmp/x", "prefix_cache": "false"})
