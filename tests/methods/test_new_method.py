"""A decode method is its own file and one registry line: here a method written in this file runs
through the engine's whole path (admission, prefill, index build, selection, window flushes) with
nothing else changed."""

from dataclasses import dataclass, field

import pytest
import torch

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError
from icekv.methods.base import Policy
from icekv.methods.selector import Selection
from icekv.methods.streaming import StreamingSelector
from icekv.policies import REGISTERED, resolve


@dataclass
class OldestSelector(StreamingSelector):
    """Attends the sink, the window and the oldest ``k`` pages of the indexed region (its pages laid
    out as StreamingLLM's); records what it picked, so the test sees the engine call it."""

    picked: list = field(init=False, default_factory=list)  # (layer, pages of head 0)

    def select(self, layer, q, k):
        oldest = torch.arange(min(k, self.pages.num_pages[layer]))
        self.picked.append((layer, oldest.tolist()))
        return Selection.ranked([oldest] * self.num_kv_heads)


def oldest(made: list) -> Policy:
    """The method's registry entry (its selectors kept in ``made``, for the test to look at)."""
    return Policy("oldest", selector=lambda plan: made.append(OldestSelector(plan.page_size)) or made[-1])


def test_an_unregistered_method_is_refused():
    with pytest.raises(ConfigError, match="unknown policy 'oldest'"):
        resolve(SelectionConfig(policy="oldest"))


def test_a_new_method_runs_through_the_engine(engine):
    made = []
    registered = REGISTERED + (oldest(made),)  # the one registry line
    plan = resolve(SelectionConfig(policy="oldest", budget=128), registered)
    args = engine.model.args
    assert plan.sparse and plan.selected_pages == 4
    assert list(plan.sparse_layers(args)) == list(range(2, args.num_layers))
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)[:600]
    seq = engine.submit(ids, SamplingConfig(max_tokens=40, ignore_eos=True), plan)
    gen = engine.run(seq)
    assert gen.new_tokens == 40 and gen.policy == "oldest" and gen.budget == 128
    (selector,) = made  # one request, one selector
    picked = selector.picked
    assert {layer for layer, _ in picked} == set(range(2, engine.model.args.num_layers))  # every budgeted layer
    assert all(pages == [0, 1, 2, 3] for _, pages in picked)  # the oldest 4 pages, every step
    assert engine.scheduler.idle and not engine.cache.has(seq.seq_id)  # finished and freed
