"""What a decode method is: one registered unit (:class:`Policy`) whose callables read a resolved
:class:`icekv.policies.PolicyPlan` (the method bound to its settings), never a policy and a config
side by side.

A method file (``methods/<name>.py``) holds its settings dataclass, its selector and its
``Policy``; the registry (:mod:`icekv.policies`) lists them. The cache regions every sparse method
shares (sink, window, the unlimited layers) are the plan's, written once there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # type names only: a method file is imported by the config it is part of
    from icekv.config.selection import SelectionConfig
    from icekv.methods.selector import PageSelector
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan

SelectorFactory = Callable[["PolicyPlan"], "PageSelector"]
LayerRule = Callable[["PolicyPlan", int], Sequence[int]]  # (plan, model depth) -> layer ids
IndexSizer = Callable[["PolicyPlan", "ModelArgs", int, str], int]
DeviceIndexSizer = Callable[["PolicyPlan", "ModelArgs", int, str, int], int]


def no_index(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str) -> int:
    """Methods that keep no page index beside the KV pool."""
    return 0


def no_device_index(plan: PolicyPlan, args: ModelArgs, tokens: int, device_type: str, dtype_bytes: int) -> int:
    """Methods whose selection keeps nothing on the compute device."""
    return 0


def no_window_queries(selection: SelectionConfig) -> int:
    """Methods that need none of the prompt's last queries."""
    return 0


@dataclass(frozen=True)
class Policy:
    """Everything about one decode method. ``selector`` None: full attention (no budget, no index)."""

    name: str
    selector: SelectorFactory | None
    index_bytes: IndexSizer = no_index  # (plan, model, tokens held, model dtype) -> host bytes of the index
    # (plan, model, tokens held, compute device type, its dtype's bytes) -> device bytes of the index
    device_index_bytes: DeviceIndexSizer = no_device_index
    compressed_context: bool = False  # can it select over a compressed context's per-head pages?
    # the layers attended under the budget (None: all but the first n_unlimited_layers)
    budgeted_layers: LayerRule | None = None
    # the layers whose keys the selector indexes (None: the budgeted ones); a dense one among them
    # also shows the selector its decode query (``observe``), as OmniKV's filter layers do
    indexed_layers: LayerRule | None = None
    # the prompt's last queries per indexed layer the selector needs before it builds (SnapKV's
    # observation window), from the selection's settings; 0: none
    window_queries: Callable[[SelectionConfig], int] = no_window_queries
    # attention estimated from weighted samples (MagicPIG), not exact over the selected pages
    sampled: bool = False
    # its index grows by insertion, in token order: a later request over a longer prompt may
    # continue a finished request's index (:mod:`icekv.policies.index_cache`)
    extends_index: bool = False
    # it shares state across consecutive budgeted layers (IceCache-R's tree groups)
    consecutive_layers: bool = False

    @property
    def sparse(self) -> bool:
        return self.selector is not None


def layers_outside(dense: frozenset[int], num_layers: int) -> tuple[int, ...]:
    """Every layer of a ``num_layers``-deep model not in ``dense`` (a method's own dense layers)."""
    return tuple(layer for layer in range(num_layers) if layer not in dense)


def scale_layers(layers: tuple[int, ...], reference_depth: int, num_layers: int) -> tuple[int, ...]:
    """Layer ids given for a ``reference_depth``-deep model, at the same relative depth in a
    ``num_layers``-deep one (sorted, distinct, in range)."""
    return tuple(sorted({min(round(layer * num_layers / reference_depth), num_layers - 1) for layer in layers}))
