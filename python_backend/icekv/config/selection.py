"""Which tokens each decode step attends to: the settings every method shares and each method's
own (plain data; :func:`icekv.policies.resolve` derives what they leave open)."""

from __future__ import annotations

from dataclasses import dataclass, field

from icekv.errors import ConfigError
from icekv.methods.arkvale import ArkValeConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.methods.magicpig import MagicPIGConfig
from icekv.methods.omnikv import OmniKVConfig
from icekv.methods.pqcache import PQCacheConfig
from icekv.methods.snapkv import SnapKVConfig

REQUEST_SETTINGS = ("policy", "budget")  # what a request may choose; every other selection setting is the server's


@dataclass(frozen=True)
class SelectionConfig:
    """``policy`` names a registered method (:mod:`icekv.policies`). ``budget`` is tokens attended
    per layer per KV head, sink and window included; the first ``n_unlimited_layers`` layers keep
    their full cache; ``full`` ignores the budget. ``n_sink_pages`` / ``n_win_pages`` None: the
    plan derives them from the budget. What the methods share is compared at one budget; what is
    a method's own is its settings field (its dataclass lives in its method file).

    A per-request override is ``replace(selection, policy=..., budget=...)``: every other setting,
    each method's own included, stays.
    """

    policy: str = "icecache"
    budget: int = 256
    page_size: int = 16
    n_sink_pages: int | None = None
    n_win_pages: int | None = None
    n_unlimited_layers: int = 2
    icecache: IceCacheConfig = field(default_factory=IceCacheConfig)
    arkvale: ArkValeConfig = field(default_factory=ArkValeConfig)
    pqcache: PQCacheConfig = field(default_factory=PQCacheConfig)
    magicpig: MagicPIGConfig = field(default_factory=MagicPIGConfig)
    omnikv: OmniKVConfig = field(default_factory=OmniKVConfig)
    snapkv: SnapKVConfig = field(default_factory=SnapKVConfig)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ConfigError(f"budget must be >= 1 token, got {self.budget}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if ((self.n_sink_pages is not None and self.n_sink_pages < 0)
                or (self.n_win_pages is not None and self.n_win_pages < 1) or self.n_unlimited_layers < 0):
            raise ConfigError("n_sink_pages must be >= 0, n_win_pages >= 1, n_unlimited_layers >= 0")
