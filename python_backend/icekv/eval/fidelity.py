"""Teacher-forced fidelity: how closely a policy's decode follows the full cache's, position by
position, over a long output.

The full cache decodes a prompt (the reference): greedily, or sampled at a temperature with a seed
(a long greedy answer often ends in a loop that repeats itself, which any policy keeping recent
tokens follows; sampling makes that less likely). Each policy then decodes with exactly the
reference's tokens fed back (teacher forcing, :attr:`SamplingConfig.forced_tokens`), so at every
output position both caches see the same text, and the policy's next-token distribution is
compared with the full cache's there:

- ``agrees``: the full cache's most likely token is also the policy's (under a greedy reference:
  the reference's token);
- ``kl``: KL(full || policy) over the full cache's ``top`` most likely tokens at that position,
  with the rest of the vocabulary as one more outcome: a lower bound of the exact divergence
  (merging outcomes never raises it), tight where those tokens hold the probability;
- ``first_divergence``: the first position where the two caches' most likely tokens differ (under a
  greedy reference: where greedy decoding under the policy would leave the reference's text;
  None: nowhere);
- ``decisive``: the positions where the full cache's most likely token holds at least
  ``DECISIVE_PROBABILITY``. Where no token is clearly favoured (common in a sampled answer), a
  small change in what is attended swaps the top two; agreement over the decisive positions
  alone tells that apart from a policy that misses what the text needs;
- ``recall`` (when probed): the share of full attention's softmax mass on the tokens the policy
  attended, averaged over heads and budgeted layers, per decode position: what the selection
  missed there.

The reference keeps ``top`` log-probabilities per position, not the full distributions, so an
output of thousands of tokens over a large vocabulary stays small. Position 0 is the prompt's own
next token, from the prefill (full attention under every policy): it agrees by construction, and
each policy's decode starts at position 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from icekv.config.request import SamplingConfig
from icekv.engine import Engine
from icekv.errors import ConfigError, IcekvError
from icekv.engine.results import Prefilled
from icekv.policies import PolicyPlan


REPEAT_RUN_TOKENS = 8  # the run length :meth:`Reference.repeated` looks for
DECISIVE_PROBABILITY = 0.5  # the full cache's favourite holds at least this at a decisive position


@dataclass(frozen=True)
class Reference:
    """The full cache's output and, per position, its most likely tokens."""

    tokens: tuple[int, ...]  # [N] the output (an end-of-sequence token not included), greedy or sampled
    top_ids: torch.Tensor  # [N, top] the most likely tokens at each position, most likely first
    top_logprobs: torch.Tensor  # [N, top + 1] their log-probabilities, then the rest's

    @property
    def decisive(self) -> torch.Tensor:
        """[N] bool: where the full cache's most likely token holds >= ``DECISIVE_PROBABILITY``."""
        return self.top_logprobs[:, 0] >= math.log(DECISIVE_PROBABILITY)

    def repeated(self, size: int, n: int = REPEAT_RUN_TOKENS) -> list[float]:
        """Per window of ``size`` positions: the share whose token ends an ``n``-token run that
        already ended earlier in the output. Near 1, the output repeats itself there, and any
        policy that keeps recent tokens follows it (a window's agreement then says little)."""
        seen, repeats = set(), [False] * min(n - 1, len(self.tokens))  # the first runs are not whole
        for end in range(n - 1, len(self.tokens)):
            run = self.tokens[end - n + 1:end + 1]
            repeats.append(run in seen)
            seen.add(run)
        return [sum(repeats[start:start + size]) / len(repeats[start:start + size])
                for start in range(0, len(repeats), size)]


@dataclass(frozen=True)
class Fidelity:
    """A policy's decode against the reference, per output position."""

    agrees: torch.Tensor  # [N] bool
    kl: torch.Tensor  # [N] float64, nats
    decisive: torch.Tensor  # [N] bool: the full cache's favourite holds >= DECISIVE_PROBABILITY
    recall: torch.Tensor | None = None  # [N] float64 when probed; NaN at position 0 (the prefill's)

    @property
    def first_divergence(self) -> int | None:
        parted = torch.nonzero(~self.agrees)
        return int(parted[0]) if len(parted) else None

    def summary(self, start: int = 0, end: int | None = None) -> dict:
        """Over positions ``start .. end-1``: the agreement rate, mean KL, the share of decisive
        positions and the agreement over them, and the mean selection recall (each None where
        there is nothing to average)."""
        agrees, decisive = self.agrees[start:end], self.decisive[start:end]
        recall = None if self.recall is None else self.recall[start:end].nanmean()
        return {"agreement": float(agrees.double().mean()), "kl": float(self.kl[start:end].mean()),
                "decisive_share": float(decisive.double().mean()),
                "decisive_agreement": float(agrees[decisive].double().mean()) if decisive.any() else None,
                "recall": None if recall is None or recall.isnan() else float(recall)}

    def windows(self, size: int) -> list[dict]:
        """:meth:`summary` per window of ``size`` positions, with the window's start."""
        return [{"start": start, **self.summary(start, start + size)} for start in range(0, len(self.agrees), size)]


def merged(logprobs: torch.Tensor, named: torch.Tensor) -> torch.Tensor:
    """logprobs [V] of a whole distribution, named ids [k] -> [k + 1]: the named outcomes'
    log-probabilities, then all the others' as one (summed over them, not taken as one minus the
    named: that difference is rounding noise where the named hold nearly everything)."""
    others = logprobs.index_fill(0, named, -torch.inf)  # [V]
    return torch.cat([logprobs[named], torch.logsumexp(others, 0, keepdim=True)])


def divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) [...] of log-probabilities p, q [..., k] over the same outcomes (0 log 0 = 0)."""
    terms = torch.where(p > -torch.inf, p.exp() * (p - q), torch.zeros_like(p))  # [..., k]
    return terms.sum(-1)


def reference(engine: Engine, prompt: Prefilled, sampling: SamplingConfig, full: PolicyPlan,
              top: int = 64) -> Reference:
    """The full cache's decode after ``prompt`` as ``sampling`` asks (greedy at temperature 0, else
    sampled from its seed; at most its ``max_tokens``), keeping each position's ``top`` most likely
    tokens. IcekvError when it is empty (an end-of-sequence token first)."""
    vocab = engine.model.args.vocab_size
    if not 1 <= top <= vocab:
        raise ConfigError(f"top must be in 1..{vocab} (this model's vocabulary), got {top}")
    ids, logprobs = [], []

    def keep(logits: torch.Tensor) -> None:
        whole = torch.log_softmax(logits.double(), -1)  # [V]
        ids.append(whole.topk(top).indices)  # [top]
        logprobs.append(merged(whole, ids[-1]))  # [top + 1]

    out = engine.decode(prompt, sampling, full, on_logits=keep)
    n = len(out.token_ids)  # an end-of-sequence step saw logits too: not a position of the output
    if not n:
        raise IcekvError("the full cache's output is empty (an end-of-sequence token first): nothing to compare")
    return Reference(tuple(out.token_ids), torch.stack(ids[:n]), torch.stack(logprobs[:n]))


def teacher_forced(engine: Engine, prompt: Prefilled, ref: Reference, plan: PolicyPlan,
                   probe: bool = False) -> Fidelity:
    """``plan``'s decode of the reference's tokens after ``prompt``, compared position by position;
    ``probe``: with its selection recall per position (a sparse plan's; slower)."""
    agrees, kl = [], []

    def compare(logits: torch.Tensor) -> None:
        at = len(agrees)
        logprobs = torch.log_softmax(logits.double(), -1)  # [V]
        agrees.append(bool(logprobs[ref.top_ids[at, 0]] == logprobs.max()))  # a tie for the top agrees
        kl.append(divergence(ref.top_logprobs[at], merged(logprobs, ref.top_ids[at])))

    out = engine.decode(prompt, SamplingConfig(max_tokens=len(ref.tokens), forced_tokens=ref.tokens), plan,
                        on_logits=compare, probe=probe)
    if len(agrees) != len(ref.tokens):
        raise RuntimeError(f"a forced decode of {len(ref.tokens)} tokens saw {len(agrees)} steps' logits")
    recall = None
    if out.step_recall:  # decode step i produces position i + 1
        if len(out.step_recall) != len(ref.tokens) - 1:
            raise RuntimeError(f"{len(out.step_recall)} probed steps for {len(ref.tokens)} positions")
        recall = torch.tensor([math.nan, *out.step_recall], dtype=torch.float64)  # [N]
    return Fidelity(torch.tensor(agrees, dtype=torch.bool), torch.stack(kl), ref.decisive, recall)
