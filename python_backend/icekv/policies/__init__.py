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


def window_queries_kept(cfg, for_later_decodes: bool) -> int:
    """The prompt's last queries per layer a prefill keeps: its policy's observation window, or,
    for a prompt prefilled for later decodes under any policy, the widest one."""
    policies = _REGISTERED if for_later_decodes else (get_policy(cfg.policy),)
    return max(p.window_queries(cfg) for p in policies)


def make_selector(cfg):
    """A fresh selector (per request) for ``cfg.policy``; None for full attention."""
    return get_policy(cfg.policy).make_selector(cfg)


__all__ = ["Policy", "get_policy", "make_selector", "policy_names", "sink_tokens", "sparse_layers", "window_queries_kept",
           "window_start"]
