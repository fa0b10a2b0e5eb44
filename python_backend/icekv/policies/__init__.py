"""The registry of decode methods (one file each in :mod:`icekv.methods`), and the one place a
request's method is resolved into its :class:`PolicyPlan`.

Adding a method: its file in ``methods/`` and its line in :data:`REGISTERED`.
"""

from __future__ import annotations

from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError
from icekv.methods import arkvale, full, icecache, magicpig, omnikv, pqcache, quest, snapkv, streaming
from icekv.methods.base import Policy
from icekv.policies.plan import PolicyPlan

REGISTERED: tuple[Policy, ...] = (
    full.POLICY,
    streaming.POLICY,
    quest.POLICY,
    icecache.POLICY,
    icecache.POLICY_R,
    arkvale.POLICY,
    pqcache.POLICY,
    omnikv.POLICY,
    snapkv.POLICY,
    magicpig.POLICY,
)


def policy_names(registered: tuple[Policy, ...] = REGISTERED) -> tuple[str, ...]:
    return tuple(p.name for p in registered)


def resolve(selection: SelectionConfig, registered: tuple[Policy, ...] = REGISTERED) -> PolicyPlan:
    """The plan of ``selection``: its method looked up by name, the sink and window pages derived
    where the selection leaves them to the budget (2 pages each, the paper's, shrunk to a quarter
    of the budget's pages each for small budgets: 64 tokens give 1 + 1, 2 selected), and a sparse
    method's budget checked for whole pages with room past them. ConfigError for an unknown name
    or a budget the method cannot use."""
    policy = next((p for p in registered if p.name == selection.policy), None)
    if policy is None:
        raise ConfigError(f"unknown policy {selection.policy!r}; choose one of {', '.join(policy_names(registered))}")
    derived = max(1, min(2, selection.budget // selection.page_size // 4))
    sink = derived if selection.n_sink_pages is None else selection.n_sink_pages
    window = derived if selection.n_win_pages is None else selection.n_win_pages
    if policy.sparse:
        _check_paged_budget(selection, sink, window)
    widest = max(p.window_queries(selection) for p in registered)
    return PolicyPlan(policy, selection, sink, window, widest)


def _check_paged_budget(selection: SelectionConfig, sink: int, window: int) -> None:
    """A method that selects pages needs a budget of whole pages with room past sink and window."""
    if selection.budget % selection.page_size:
        raise ConfigError(f"budget {selection.budget} is not a multiple of the page size {selection.page_size}")
    fixed = (sink + window) * selection.page_size
    if selection.budget <= fixed:
        raise ConfigError(f"budget {selection.budget} must exceed sink + window = {fixed} tokens "
                          f"({sink} + {window} pages of {selection.page_size})")


__all__ = ["REGISTERED", "PolicyPlan", "policy_names", "resolve"]
