"""A request's decode method bound to its settings: what every backend, sizer and front end reads.

Built only by :func:`icekv.policies.resolve`, which looks the name up, derives the sink and window
pages a budget leaves room for and checks the budget, once per request. Nothing downstream takes
a policy and a :class:`SelectionConfig` side by side: it takes the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError
from icekv.methods.base import Policy

if TYPE_CHECKING:
    from icekv.methods.selector import PageSelector
    from icekv.model import ModelArgs


@dataclass(frozen=True)
class PolicyPlan:
    """``policy`` over ``selection``, with its derived region: ``sink_pages`` pages at the start of
    a request's own tokens, ``window_pages`` at its end, ``widest_window_queries`` the most prompt
    queries any registered method needs (what a prefill for later decodes keeps)."""

    policy: Policy
    selection: SelectionConfig
    sink_pages: int
    window_pages: int
    widest_window_queries: int

    # ---- what the method is
    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def sparse(self) -> bool:
        return self.policy.sparse

    @property
    def sampled(self) -> bool:
        return self.policy.sampled

    @property
    def extends_index(self) -> bool:
        return self.policy.extends_index

    @property
    def compressed_context(self) -> bool:
        return self.policy.compressed_context

    # ---- the region every sparse method shares
    @property
    def budget(self) -> int:
        return self.selection.budget

    @property
    def page_size(self) -> int:
        return self.selection.page_size

    @property
    def selected_pages(self) -> int:
        """Pages picked per step per KV head, besides sink and window."""
        return self.budget // self.page_size - self.sink_pages - self.window_pages

    @property
    def sink_tokens(self) -> int:
        """Sink tokens at the start of a request's own pages."""
        return self.sink_pages * self.page_size

    @property
    def window_tokens(self) -> int:
        """The most tokens the window holds before its oldest page is flushed into the index."""
        return (self.window_pages + 1) * self.page_size

    def window_start(self, sink_end: int, length: int) -> int:
        """First position of the window: the page of the newest token and the pages before it; never
        before ``sink_end``, so the indexed region ``sink_end .. window_start`` is never negative."""
        newest_page = (length - 1) // self.page_size
        return max(sink_end, (newest_page - self.window_pages + 1) * self.page_size)

    def selects(self, tokens_held: int) -> bool:
        """Does a request that holds at most ``tokens_held`` tokens select pages? Not when they all
        fit in the budget: it attends every token (full attention), with no index to build."""
        return self.sparse and tokens_held > self.budget

    def sparse_layers(self, args: ModelArgs) -> Sequence[int]:
        """The layers that attend under the budget: the method's own rule, or all but the first
        ``n_unlimited_layers``. A method sees a model with local (sliding-window) layers as its
        global layers alone: its rule counts those, and a local layer attends its window whole."""
        if not self.sparse:
            return ()
        if self.policy.budgeted_layers is not None:
            return _by_rank(args, lambda depth: self.policy.budgeted_layers(self, depth))
        return _by_rank(args, lambda depth: range(min(self.selection.n_unlimited_layers, depth), depth))

    def index_layers(self, args: ModelArgs) -> Sequence[int]:
        """The layers whose keys the selector indexes (built after prefill, or during it), global
        ones only, counted as :meth:`sparse_layers` counts them."""
        if not self.sparse:
            return ()
        if self.policy.indexed_layers is not None:
            return _by_rank(args, lambda depth: self.policy.indexed_layers(self, depth))
        return self.sparse_layers(args)

    def check_model(self, args: ModelArgs) -> None:
        """ConfigError where the method cannot run on this model: one that shares state across
        consecutive layers, on a model whose global layers are not consecutive."""
        if self.sparse and self.policy.consecutive_layers and args.local_layers:
            raise ConfigError(f"policy {self.name!r} shares its index across consecutive layers, and this model's "
                              "global layers are apart (sliding-window layers between them); use 'icecache'")

    @property
    def window_queries(self) -> int:
        """The prompt's last queries per indexed layer the selector needs before it builds."""
        return self.policy.window_queries(self.selection)

    def window_queries_kept(self, for_later_decodes: bool) -> int:
        """The prompt's last queries per layer a prefill keeps: this method's, or, for a prompt
        prefilled for later decodes under any method, the widest."""
        return self.widest_window_queries if for_later_decodes else self.window_queries

    # ---- what it builds and holds
    def make_selector(self) -> PageSelector | None:
        """A fresh selector for one request; None for full attention."""
        return self.policy.selector(self) if self.sparse else None

    def index_bytes(self, args: ModelArgs, tokens: int, dtype) -> int:
        """Host bytes of one request's page index over ``tokens`` tokens of a model in ``dtype``
        (a torch dtype or its name: the KV's values, which set the page keys' width)."""
        return self.policy.index_bytes(self, args, tokens, str(dtype).removeprefix("torch."))

    def device_index_bytes(self, args: ModelArgs, tokens: int, device_type: str, dtype_bytes: int) -> int:
        """Compute-device bytes of what the selector keeps there over ``tokens`` tokens."""
        return self.policy.device_index_bytes(self, args, tokens, device_type, dtype_bytes)


def _by_rank(args: ModelArgs, rule: Callable[[int], Sequence[int]]) -> tuple[int, ...]:
    """The global layers ``rule`` picks, given their count, by rank among them."""
    layers = args.global_layers
    return tuple(layers[i] for i in rule(len(layers)))
