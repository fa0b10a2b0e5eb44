"""The plugin's settings, with icekv's names: the server's from vLLM's ``--additional-config``
(``{"icekv": {"policy": ..., "budget": ..., "search": ...}}``, any server setting of a
selection field, as ``icekv serve`` takes them) and a request's ``policy`` and ``budget`` from its
``vllm_xargs`` (vLLM's ``SamplingParams.extra_args``)."""

from __future__ import annotations

from dataclasses import replace

from icekv.config.selection import REQUEST_SETTINGS, SelectionConfig
from icekv.config.settings import BY_NAME, serving_config
from icekv.errors import ConfigError
from icekv.methods.base import Policy
from icekv.policies import REGISTERED, PolicyPlan, resolve

PREFIX = "engine.selection."


def server_selection(additional_config: dict | None) -> SelectionConfig | None:
    """The server's selection from ``additional_config["icekv"]``; None where there is none (the
    backend is then vLLM's own)."""
    given = (additional_config or {}).get("icekv")
    if given is None:
        return None
    if not isinstance(given, dict):
        raise ConfigError(f"additional_config icekv must be an object of settings, got {given!r}")
    selection_settings = sorted(s.name for s in BY_NAME.values() if s.fields[0].startswith(PREFIX))
    unknown = sorted(set(given) - set(selection_settings))
    if unknown:
        raise ConfigError(f"icekv settings {unknown} are not selection settings; known: {', '.join(selection_settings)}")
    selection = serving_config({name: str(value) for name, value in given.items()}).engine.selection
    plan(selection)  # refused here, at load, when it cannot run
    return selection


def request_selection(server: SelectionConfig, extra_args: dict | None) -> SelectionConfig:
    """The server's selection with what the request's ``vllm_xargs`` override (every other setting kept)."""
    overrides = {k: BY_NAME[k].parse(str(v)) for k, v in (extra_args or {}).items() if k in REQUEST_SETTINGS}
    return replace(server, **overrides) if overrides else server


def plan(selection: SelectionConfig) -> PolicyPlan:
    """``selection`` resolved; ConfigError for a method the backend cannot run inside vLLM."""
    resolved = resolve(selection)
    if not runs_inside_vllm(resolved.policy):
        names = [p.name for p in REGISTERED if runs_inside_vllm(p)]
        raise ConfigError(f"policy {resolved.name!r} is not available inside vLLM; choose one of {', '.join(names)}")
    return resolved


def runs_inside_vllm(policy: Policy) -> bool:
    """Does the method's selector need only the keys of the layers the budget binds (no prompt
    queries, dense filter layers of its own or sampled attention)? Those the backend runs."""
    return (policy.budgeted_layers is None and policy.indexed_layers is None and not policy.sampled
            and policy.window_queries(SelectionConfig()) == 0)
