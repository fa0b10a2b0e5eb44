"""Pick the next token from logits: penalties and biases first, then greedy, or temperature +
nucleus sampling with a seed."""

from __future__ import annotations

import torch

from icekv.config.request import SamplingConfig


def adjusted_logits(logits: torch.Tensor, cfg: SamplingConfig, prompt_ids: torch.Tensor,
                    output_ids: torch.Tensor) -> torch.Tensor:
    """logits [V] with ``cfg``'s penalties and biases applied (a new tensor): the repetition
    penalty over every token of prompt_ids [P] and output_ids [O], then the frequency and presence
    penalties over output_ids, then the logit bias."""
    logits = logits.float().clone()  # [V]
    vocab = logits.shape[0]
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.cat([prompt_ids, output_ids])] = True  # [V]
        scaled = torch.where(logits > 0, logits / cfg.repetition_penalty, logits * cfg.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if cfg.frequency_penalty or cfg.presence_penalty:
        counts = torch.bincount(output_ids, minlength=vocab).float()  # [V]
        logits -= cfg.frequency_penalty * counts + cfg.presence_penalty * (counts > 0).float()
    if cfg.logit_bias:  # token ids checked against the vocabulary at submit
        logits.index_add_(0, torch.tensor([t for t, _ in cfg.logit_bias]), torch.tensor([b for _, b in cfg.logit_bias]))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, decode) -> list[dict]:
    """Per row of logits [n, V]: the log-probability of ``tokens[i]`` and the ``top`` most likely
    tokens, most likely first, each with its text (``decode``: token ids -> text)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()  # [n]
    best = torch.topk(logprobs, top) if top else None  # [n, top]
    out = []
    for i, token in enumerate(tokens):
        alternatives = [] if best is None else [
            {"token_id": t, "token": decode([t]), "logprob": lp}
            for lp, t in zip(best.values[i].tolist(), best.indices[i].tolist())]
        out.append({"token_id": token, "token": decode([token]), "logprob": chosen[i], "top_logprobs": alternatives})
    return out


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """logits [V] (adjusted already) -> a token id. Greedy when ``cfg.temperature == 0``."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # [V]
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # [V]
        outside = torch.cumsum(sorted_p, 0) - sorted_p > cfg.top_p  # [V] mass before >= top_p
        sorted_p[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
