"""The plugin's settings take icekv's names and refuse what the backend cannot run (no vLLM needed)."""

import pytest

from icekv.errors import ConfigError
from icekv.vllm.settings import plan, request_selection, server_selection


def test_the_server_takes_selection_settings_by_their_icekv_names():
    assert server_selection(None) is None and server_selection({}) is None  # vLLM's own backend
    selection = server_selection({"icekv": {"policy": "quest", "budget": "128", "search": "walk"}})
    assert (selection.policy, selection.budget, selection.icecache.search) == ("quest", 128, "walk")
    override = request_selection(selection, {"budget": 256, "other_plugin": 1})
    assert (override.policy, override.budget, override.icecache.search) == ("quest", 256, "walk")


@pytest.mark.parametrize("given, message", [
    ({"page_size": 32}, "not selection settings"),
    ({"polcy": "quest"}, "not selection settings"),
    ({"budget": "lots"}, "budget must be an integer"),
    ({"policy": "snapkv"}, "not available inside vLLM"),
    ({"policy": "icecache", "budget": 100}, "not a multiple of the page size"),
])
def test_settings_it_cannot_run_are_refused_at_load(given, message):
    with pytest.raises(ConfigError, match=message):
        server_selection({"icekv": given})
    assert plan(request_selection(server_selection({"icekv": {}}), {"policy": "arkvale"})).name == "arkvale"
