"""The settings table is the one declaration of the server's settings: the CLI, config.pbtxt
parsing, the ConfigMap and the README follow it."""

import re
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

import pytest
import yaml

from icekv.cli import _serving_parameters, build_parser
from icekv.config.engine import EngineConfig
from icekv.config.selection import SelectionConfig
from icekv.config.serving import ServingConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.config.paths import build_config, field_value
from icekv.errors import ConfigError
from icekv.policies import resolve
from icekv.config.settings import SETTINGS, choices, readme_table, serving_config

ROOT = Path(__file__).resolve().parents[1]


def _paths(config, prefix=""):
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            yield from _paths(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_setting_names_real_fields_and_its_defaults_parse_back_to_the_default_config():
    known = set(_paths(ServingConfig()))
    for setting in SETTINGS:
        assert set(setting.fields) <= known, setting.name
    texts = {s.name: str(s.default()) for s in SETTINGS if s.default() is not None}
    assert serving_config(texts) == ServingConfig()


def test_the_readme_configuration_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert readme_table() in readme, "README's configuration table differs: paste icekv.config.settings.readme_table()"


def test_the_configmap_holds_the_settings_marked_for_it_and_deployment_passes_each_as_its_flag():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/base/configmap.yaml").read_text()) if d]
    keys = set(docs[0]["data"]) - {"ICEKV_CACHE"}  # the cache folder is an environment variable, not a setting
    assert keys == {s.configmap_key for s in SETTINGS if s.configmap}
    deployment = (ROOT / "deploy/base/deployment.yaml").read_text()
    for setting in SETTINGS:
        if setting.configmap:
            assert f"{setting.cli_flag}=$({setting.configmap_key})" in deployment, setting.name


# settings that are none by default, where "1" is no value
UNSET_EXAMPLES = {"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://*:5558"}


def test_every_setting_is_a_serve_flag_that_becomes_its_triton_parameter():
    argv = ["serve"]
    for setting in SETTINGS:
        unset = choices(setting)[0] if choices(setting) else UNSET_EXAMPLES.get(setting.name, "1")  # default none
        if setting.name != "model_dir":
            argv += [setting.cli_flag, str(setting.default() if setting.default() is not None else unset)]
    params = _serving_parameters(build_parser().parse_args(argv))
    assert set(params) == {s.name for s in SETTINGS} - {"model_dir"}


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "--budget must be >= 1"),
    (["--budget", "many"], "--budget must be an integer"),
    (["--max-queue-wait-s", "soon"], "--max-queue-wait-s must be a number"),
    (["--search", "beam"], "--search must be one of walk, exhaustive, centroids, got 'beam'"),
    (["--policy", "magic"], "invalid choice: 'magic'"),
])
def test_bad_flags_are_refused_with_their_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("params, message", [
    ({"policy": "magic"}, "unknown policy 'magic'"),
    ({"policy": "quest", "budget": "100"}, "not a multiple of the page size"),
    ({"kv2": "speed=9"}, "kv2 has no setting 'speed'"),
    ({"store_max_bytes": "-1"}, "store_max_bytes must be >= 0"),
    ({"max_queue_wait_s": "0"}, "max_queue_wait_s must be > 0"),
])
def test_parameters_the_registries_refuse_fail_when_the_config_is_read(params, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        serving_config(params)


def test_every_front_end_starts_from_the_library_defaults():
    """One default per setting: the library's engine, the server's (with no parameters, and as the
    shipped model repository and the ConfigMap spell it), and every CLI command's flags."""
    library = EngineConfig()
    assert ServingConfig().engine == library and serving_config({}).engine == library
    shipped = re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}',
                         (ROOT / "model_repository/icekv/config.pbtxt").read_text())
    assert serving_config(dict(shipped)).engine == library
    configmap = yaml.safe_load((ROOT / "deploy/base/configmap.yaml").read_text())["data"]
    by_key = {s.configmap_key: s for s in SETTINGS if s.configmap}
    sized = {"model_dir", "device", "store", "pool_tokens", "max_index_bytes"}  # the deployment's own
    for key, text in configmap.items():
        setting = by_key.get(key)
        if setting is not None and setting.name not in sized and text != "":
            assert setting.parse(text) == setting.default(), key
    parser = build_parser()
    generate = parser.parse_args(["generate", "--prompt", "x"])
    assert (generate.policy, generate.budget) == (library.selection.policy, library.selection.budget)
    from icekv.cli.common import _icecache_config

    for command in (["generate", "--prompt", "x"], ["eval", "--out", "x"], ["bench", "decode"], ["bench", "batch"]):
        assert _icecache_config(parser.parse_args(command)) == library.selection.icecache, command
    for command in (["bench", "decode"], ["bench", "batch"], ["size"]):
        assert parser.parse_args(command).budget == library.selection.budget, command
    assert library.selection.icecache.search == "centroids" and library.selection.policy == "icecache"


def test_build_config_derives_dependent_defaults_from_the_values_it_is_given():
    built = build_config(EngineConfig, {"selection.budget": 64, "selection.policy": "icecache"})
    assert built.selection == SelectionConfig(policy="icecache", budget=64)
    plan = resolve(built.selection)
    assert (plan.sink_pages, plan.window_pages) == (1, 1)  # a quarter of 4 pages each
    wider = resolve(replace(built.selection, budget=256))  # derived again: nothing stale in the config
    assert (wider.sink_pages, wider.window_pages, wider.selected_pages) == (2, 2, 12)
    one_page_size = serving_config({"page_size": "32", "budget": "512"}).engine
    assert one_page_size.paging.page_size == one_page_size.selection.page_size == 32


@pytest.mark.parametrize("command", [["eval", "--out", "x"], ["bench", "decode"], ["bench", "batch"]])
def test_eval_and_bench_take_every_icecache_setting(command):
    """The server's IceCache settings are flags of eval and bench too, defaulting to the engine's."""
    from icekv.cli.common import _icecache_config

    assert _icecache_config(build_parser().parse_args(command)) == IceCacheConfig()
    args = build_parser().parse_args([*command, "--gqa-merge", "head_order", "--rerank", "4", "--min-candidates", "200",
                                      "--search", "centroids"])
    assert _icecache_config(args) == IceCacheConfig(gqa_merge="head_order", rerank=4, min_candidates=200,
                                                    search="centroids")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--gqa-merge", "random"])


def test_the_config_package_is_plain_data():
    """Frozen configs are never written after construction (derived values are the plan's)."""
    package = ROOT / "python_backend/icekv/config"
    assert not [p.name for p in package.glob("*.py") if "__setattr__" in p.read_text()]
