"""Page indexes of finished (or preempted) requests, kept for the next request that continues
their tokens: a conversation's next turn, an agent's next step. Used by icekv's engine and by its
vLLM plugin.

A sparse policy whose index grows by insertion (IceCache's DCI-trees, Quest's page bounds:
``Policy.extends_index``) indexes a request's tokens between the sink and the window. When the
request ends, that index covers its prompt and most of its answer; the next turn's prompt starts
with the same tokens, so it takes the index over and inserts only its new tokens, as decoding
inserts the pages that leave the window, instead of building over the whole conversation again.

An index is moved, never copied: the request that takes it owns it, and a second request over the
same prefix at the same time builds its own. It is keyed by the tokens it covers (icekv's page hash
chain, :func:`icekv.kv.prefix_cache.page_keys`) and the plan it was built under. The keys of tokens
a request generated under a budget are the ones its sparse decode wrote, which a full prefill of the
same tokens computes slightly differently: the continued index scores those pages with their
decode-time keys (the pages attended are read from the pool, exact). Kept indexes are host memory;
their owner trims them, least recently kept first (:meth:`IndexCache.trim`): the engine's KV-cache
manager under ``max_index_bytes`` for the index of a request it admits, the vLLM plugin within
vLLM's KV cache's bytes less the live indexes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from icekv.kv.prefix_cache import page_keys
from icekv.methods.selector import PageSelector
from icekv.policies import PolicyPlan


@dataclass(frozen=True)
class KeptIndex:
    selector: PageSelector
    covered: int  # the indexed region ends here (tokens [sink end, covered) are in it)
    nbytes: int


@dataclass
class IndexCacheStats:
    hits: int = 0  # requests that continued a kept index
    reused_tokens: int = 0  # tokens they did not index again
    evictions: int = 0


class IndexCache:
    """Kept indexes by (the key of the tokens they cover, their plan), least recently kept first."""

    def __init__(self, model_id: str, page_size: int):
        self.model_id, self.page_size = model_id, page_size
        self._kept: OrderedDict[tuple[bytes, PolicyPlan], KeptIndex] = OrderedDict()
        self.nbytes = 0  # host bytes of the kept indexes (a counter: the metrics read it from another thread)
        self.stats = IndexCacheStats()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, ids: list[int], covered: int, plan: PolicyPlan, selector: PageSelector) -> None:
        """Keep ``selector``, whose region ends at ``covered`` of the tokens ``ids``."""
        if covered % self.page_size or covered == 0 or covered > len(ids):
            return  # a region that ends inside a page (at the sink) has nothing worth keeping
        key = (page_keys(self.model_id, ids[:covered], self.page_size)[-1], plan)
        self._drop(key)
        self._kept[key] = KeptIndex(selector, covered, selector.index_bytes())
        self.nbytes += self._kept[key].nbytes

    def find(self, ids: list[int], most: int, plan: PolicyPlan) -> tuple | None:
        """The key of the kept index over the longest prefix of ``ids`` it may continue, covering
        at most ``most`` tokens; None: none."""
        keys = page_keys(self.model_id, ids[:most], self.page_size)
        for chain in reversed(keys):
            if (chain, plan) in self._kept:
                return chain, plan
        return None

    def take(self, ids: list[int], most: int, plan: PolicyPlan) -> KeptIndex | None:
        """The kept index :meth:`find` names, now the caller's (no longer kept)."""
        key = self.find(ids, most, plan)
        if key is None:
            return None
        kept = self._drop(key)
        self.stats.hits += 1
        self.stats.reused_tokens += kept.covered
        return kept

    def trim(self, most_bytes: int) -> None:
        """Drop kept indexes, least recently kept first, until they hold at most ``most_bytes``."""
        while self._kept and self.nbytes > most_bytes:
            self._drop(next(iter(self._kept)))
            self.stats.evictions += 1

    def _drop(self, key) -> KeptIndex | None:
        kept = self._kept.pop(key, None)
        self.nbytes -= kept.nbytes if kept is not None else 0
        return kept
