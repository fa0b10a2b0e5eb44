"""The registry of decode-time policies: a name -> everything about that policy (one file each).

Adding a policy: a file here that makes a :class:`Policy`, and its line in :data:`_REGISTERED`.
"""

from __future__ import annotations

from icekv.errors import ConfigError
from icekv.policies import arkvale, full, icecache, magicpig, omnikv, pqcache, quest, snapkv, streaming
from icekv.policies.base import Policy, sink_tokens, sparse_layers, window_start

_REGISTERED = (full.POLICY, streaming.POLICY, quest.POLICY, icecache.ICECACHE, icecache.ICECACHE_R, arkvale.POLICY,
               pqcache.POLICY, omnikv.POLICY, snapkv.POLICY, magicpig.POLICY)


def policy_names() -> tuple[str, ...]:
    return tuple(p.name for p in _REGISTERED)


def get_policy(name: str) -> Policy:
    for policy in _REGISTERED:
        if policy.name == name:
            return policy
    raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(policy_names())}")


def resolve(cfg) -> Policy:
    """The policy ``cfg`` (a SelectionConfig) names, once its settings are checked against it: a
    sparse policy needs a budget of whole pages past its sink and window. The one lookup a request's
    policy gets (at submit); ConfigError for an unknown name or a budget it cannot use."""
    policy = get_policy(cfg.policy)
    if policy.sparse:
        cfg.check_paged_budget()
    return policy


def make_selector(cfg):
    """A fresh selector for ``cfg``'s policy (resolved here: for callers outside the engine, whose
    requests carry theirs); None for full attention."""
    return resolve(cfg).make_selector(cfg)


def window_queries_kept(policy: Policy, cfg, for_later_decodes: bool) -> int:
    """The prompt's last queries per layer a prefill keeps: its policy's observation window, or,
    for a prompt prefilled for later decodes under any policy, the widest one."""
    policies = _REGISTERED if for_later_decodes else (policy,)
    return max(p.window_queries(cfg) for p in policies)


__all__ = ["Policy", "get_policy", "make_selector", "policy_names", "resolve", "sink_tokens", "sparse_layers",
           "window_queries_kept", "window_start"]
