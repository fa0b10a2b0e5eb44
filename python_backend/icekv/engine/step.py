"""One engine step over a batch of sequences: a flat token batch through the model once.

Each sequence contributes its next decode token or a chunk of its prompt. The dense layers run
once over the flat batch ``[N]`` (tokens with their own positions); each layer's attention is
split back by sequence (:class:`icekv.engine.decode_plan.DecodePlan`), so requests under
different policies share a step.
"""

from __future__ import annotations

import time

import torch

from icekv.engine.backends import check_context, decode_backend, prefill_backend
from icekv.engine.decode_plan import DecodePlan, SearchThreads
from icekv.engine.sampling import token_logprobs
from icekv.engine.sequence import Phase, Sequence
from icekv.kv import PagedKVCache
from icekv.model import Decoder, Tokenizer
from icekv.policies.index_cache import IndexCache

Work = list[tuple[Sequence, int]]  # (sequence, tokens it feeds this step)


class StepRunner:
    """Moves the scheduled sequences forward by one step: prepares their backends, runs the
    model once over all their tokens, then samples (or records prefill progress) per sequence."""

    def __init__(self, model: Decoder, tokenizer: Tokenizer, cache: PagedKVCache, index_threads: int,
                 chunk_tokens: int, search_threads: int = 0, indexes: IndexCache | None = None):
        self.model, self.tokenizer, self.cache, self.index_threads = model, tokenizer, cache, index_threads
        self.chunk_tokens = chunk_tokens  # the most prompt tokens of one request a step
        self.indexes = indexes  # finished requests' indexes, for decodes that continue them
        self.searches = SearchThreads(search_threads)
        self.eos = set(model.args.eos_token_ids)

    def run(self, work: Work) -> None:
        ready, tokens, positions = [], [], []
        for seq, n in work:
            try:
                fed = self._prepare(seq, n)
                if fed is not None:
                    positions.append(seq.backend.begin_step(len(fed)))  # [n] (reserves its pages)
                    ready.append(seq)
                    tokens.append(fed)
            except Exception as e:
                seq.fail(e)
        if not ready:
            return
        sizes = [len(t) for t in tokens]
        batch = DecodePlan(ready, sizes, self.cache, self.searches)
        starts, ends = batch.bounds[:-1], batch.bounds[1:]
        wanted = {}  # sequence -> its rows whose logits it reads: its last (to sample), or all (prompt logprobs)
        for i, seq in enumerate(ready):
            if seq.phase is Phase.PREFILL and seq.request.sampling.prompt_logprobs is not None:
                wanted[i] = list(range(starts[i], ends[i]))
            elif seq.decoding or seq.remaining_prompt == sizes[i]:
                wanted[i] = [ends[i] - 1]
        t0 = time.perf_counter()
        device = self.cache.compute
        try:
            flat = torch.tensor([t for ts in tokens for t in ts], device=device)  # [N]
            rows = torch.tensor([r for rs in wanted.values() for r in rs], dtype=torch.long, device=device)  # [R]
            logits = self.model(flat, torch.cat(positions).to(device), batch, logit_rows=rows).cpu()  # [R, V]
        except Exception as e:  # outside any one sequence's attention: the whole step failed
            for seq in ready:
                seq.fail(e)
            return
        rows = dict(zip(wanted, logits.split([len(rs) for rs in wanted.values()])))  # i -> [rows, V]
        decoded = []  # the sequences that took a decode step: each waited the whole step for its token
        for i, seq in enumerate(ready):
            if i in batch.failed:
                seq.fail(batch.failed[i])
                continue
            try:
                decoding = seq.phase is Phase.DECODE
                seq.backend.end_step()
                self._advance(seq, sizes[i], rows.get(i))
                if decoding:
                    decoded.append(seq)
            except Exception as e:
                seq.fail(e)
        step_s = time.perf_counter() - t0  # the forward, the index inserts and the sampling
        for seq in decoded:
            seq.step_s.append(step_s)

    def _prepare(self, seq: Sequence, n: int) -> list[int] | None:
        """The token ids ``seq`` feeds this step (its backend set up); None: nothing to feed."""
        if seq.decoding and seq.phase is Phase.WAITING:  # decode over an existing prompt
            seq.prefill_s = seq.request.prefilled.prefill_s
            seq.start_decode(self.tokenizer, self.eos, seq.request.prefilled.logits)
        elif seq.phase is Phase.WAITING and seq.request.prefilled is not None:  # its suffix, over the prompt's KV
            seq.phase, seq.t_prefill = Phase.PREFILL, time.perf_counter()
            seq.backend = prefill_backend(self.cache, seq, self.model.args, self.index_threads, self.chunk_tokens,
                                          self.indexes)
        elif seq.phase is Phase.WAITING:
            if seq.request.context is not None:
                check_context(seq.request.context, self.cache, self.model.args)
            most = seq.most_cached_tokens if seq.uses_prefix_cache else 0
            seq.cached_tokens = seq.prefill_done = self.cache.add(seq.seq_id, seq.request.prompt_ids, most)
            seq.phase, seq.t_prefill = Phase.PREFILL, time.perf_counter()
            seq.backend = prefill_backend(self.cache, seq, self.model.args, self.index_threads, self.chunk_tokens,
                                          self.indexes)
        if seq.phase is Phase.DONE:
            return None
        if seq.phase is Phase.PREFILL:
            return seq.request.prompt_ids[seq.prefill_done : seq.prefill_done + n]
        if not seq.decoder_ready:  # the first decode step: build (or take) its index, not decode time
            t0 = time.perf_counter()
            seq.backend, seq.decoder_ready = decode_backend(self.cache, seq, self.model.args, self.indexes), True
            seq.t_decode += time.perf_counter() - t0
        return [seq.next_token]

    def _advance(self, seq: Sequence, n: int, logits: torch.Tensor | None) -> None:
        """``logits`` [rows, V]: the rows ``seq`` asked for this step (None: none)."""
        if seq.phase is Phase.DECODE:
            seq.accept(logits[-1])
            return
        if seq.request.sampling.prompt_logprobs is not None:
            self._score_prompt(seq, logits)
        logits = logits[-1] if logits is not None else None
        seq.prefill_done += n
        if seq.on_progress:
            seq.on_progress(seq.prefill_done, len(seq.request.prompt_ids))
        if seq.remaining_prompt:
            return
        seq.prefill_s, seq.logits = time.perf_counter() - seq.t_prefill, logits
        seq.window_queries = seq.backend.kept_queries or None
        if seq.uses_prefix_cache:  # its prompt's full pages are final: requests starting now share them
            self.cache.publish(seq.seq_id, seq.request.prompt_ids)
        if seq.request.prefill_only:
            seq.phase = Phase.DONE
            return
        seq.start_decode(self.tokenizer, self.eos, logits)

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens this chunk's rows [n, V] predict (row j: the
        token after position prefill_done + j); the first prompt token has none (logprob None)."""
        prompt, start, top = seq.request.prompt_ids, seq.prefill_done, seq.request.sampling.prompt_logprobs
        if start == 0:
            first = prompt[0]
            seq.prompt_logprobs.append({"token_id": first, "token": self.tokenizer.decode([first]), "logprob": None,
                                        "top_logprobs": []})
        rows = logits[: len(prompt) - start - 1]  # [<= n, V]: the last prompt row predicts no prompt token
        if len(rows):
            seq.prompt_logprobs += token_logprobs(rows, prompt[start + 1 : start + 1 + len(rows)], top,
                                                  self.tokenizer.decode)
