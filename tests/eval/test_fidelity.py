"""Teacher forcing and the fidelity measures: forced tokens are emitted as given, teacher forcing
under the full cache reproduces the free-running logits exactly, the merged KL is a lower bound
of the exact one, and a policy that drops what the answer needs parts from the full cache."""

import json
import subprocess
import sys

import pytest
import torch

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError
from icekv.eval.fidelity import Fidelity, Reference, divergence, merged, reference, teacher_forced
from icekv.policies import resolve
from tests.test_cli import refused

FULL = resolve(SelectionConfig(policy="full"))
PROMPT = ("The keeper of the northern lighthouse logged every ship that passed. " * 40
          + "Now retell the log in detail, ship by ship.")


def test_forced_tokens_need_their_count_as_max_tokens_and_token_ids():
    with pytest.raises(ConfigError, match="max_tokens must be the number of forced_tokens"):
        SamplingConfig(max_tokens=3, forced_tokens=(1, 2))
    with pytest.raises(ConfigError, match="token ids >= 0"):
        SamplingConfig(max_tokens=1, forced_tokens=(-1,))
    with pytest.raises(ConfigError, match="stop, json_schema and grammar do not apply"):
        SamplingConfig(max_tokens=1, forced_tokens=(5,), stop=("\n",))


def test_a_forced_decode_emits_exactly_the_forced_tokens(engine):
    prompt = engine.prefill(engine.tokenizer.encode(PROMPT))
    try:
        forced = tuple(torch.randint(100, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist())
        assert engine.model.args.eos_token_ids
        forced = forced[:5] + engine.model.args.eos_token_ids[:1] + forced[5:]  # an end-of-sequence token inside
        out = engine.decode(prompt, SamplingConfig(max_tokens=len(forced), forced_tokens=forced), FULL)
        assert tuple(out.token_ids) == forced  # not what greedy decoding picks, and not cut at the end-of-sequence
        with pytest.raises(ConfigError, match="forced_tokens names token"):
            engine.decode(prompt, SamplingConfig(max_tokens=1, forced_tokens=(engine.model.args.vocab_size,)), FULL)
    finally:
        engine.release(prompt)


def test_teacher_forcing_under_the_full_cache_reproduces_the_free_running_logits(engine):
    prompt = engine.prefill(engine.tokenizer.encode(PROMPT))
    try:
        free, forced = [], []
        out = engine.decode(prompt, SamplingConfig(max_tokens=40), FULL, on_logits=free.append)
        tokens = tuple(out.token_ids)
        engine.decode(prompt, SamplingConfig(max_tokens=len(tokens), forced_tokens=tokens), FULL,
                      on_logits=forced.append)
        assert len(forced) == len(tokens) and all(torch.equal(a, b) for a, b in zip(free, forced))
        with pytest.raises(ConfigError, match="top must be in 1.."):
            reference(engine, prompt, SamplingConfig(max_tokens=40), FULL, top=engine.model.args.vocab_size + 1)
        ref = reference(engine, prompt, SamplingConfig(max_tokens=40), FULL, top=16)
        assert ref.tokens == tokens and ref.top_ids[:, 0].tolist() == list(tokens)  # greedy: the most likely
        same = teacher_forced(engine, prompt, ref, FULL)
        assert same.agrees.all() and torch.equal(same.kl, torch.zeros(len(tokens), dtype=torch.float64))
        assert same.first_divergence is None
    finally:
        engine.release(prompt)


def test_a_sampled_reference_is_seeded_and_agreement_compares_the_most_likely_tokens(engine):
    prompt = engine.prefill(engine.tokenizer.encode(PROMPT))
    try:
        hot = SamplingConfig(max_tokens=40, temperature=1.5, seed=3)
        ref = reference(engine, prompt, hot, FULL, top=16)
        assert reference(engine, prompt, hot, FULL, top=16).tokens == ref.tokens  # the seed fixes the text
        off_top = [t != int(top) for t, top in zip(ref.tokens, ref.top_ids[:, 0])]
        assert any(off_top)  # sampled: some tokens are not the full cache's most likely
        same = teacher_forced(engine, prompt, ref, FULL)
        assert same.agrees.all() and same.first_divergence is None  # the full cache agrees with itself there too
        assert torch.equal(same.kl, torch.zeros(len(ref.tokens), dtype=torch.float64))
        assert torch.equal(same.decisive, ref.decisive) and same.decisive.any()
        assert same.summary()["decisive_agreement"] == 1.0
        recent = teacher_forced(engine, prompt, ref, resolve(SelectionConfig(policy="streaming", budget=48)))
        assert not recent.agrees.all()
    finally:
        engine.release(prompt)


def test_a_policy_that_keeps_only_recent_tokens_parts_from_the_full_cache(engine):
    prompt = engine.prefill(engine.tokenizer.encode(PROMPT))
    try:
        ref = reference(engine, prompt, SamplingConfig(max_tokens=48), FULL, top=32)
        streaming = resolve(SelectionConfig(policy="streaming", budget=48))
        recent = teacher_forced(engine, prompt, ref, streaming)
        assert recent.kl.mean() > 0.01 and len(recent.kl) == len(ref.tokens)
        assert recent.recall is None and teacher_forced(engine, prompt, ref, FULL, probe=True).recall is None
        probed = teacher_forced(engine, prompt, ref, streaming, probe=True)
        assert torch.equal(probed.agrees, recent.agrees) and torch.allclose(probed.kl, recent.kl)  # probing only reads
        assert probed.recall[0].isnan() and ((probed.recall[1:] > 0) & (probed.recall[1:] <= 1 + 1e-6)).all()
        assert probed.recall[1:].mean() < 0.99  # the prompt's middle is out of its window: mass missed
        assert probed.summary(0, 16)["recall"] == pytest.approx(float(probed.recall[1:16].mean()))
        windows = recent.windows(16)
        assert [w["start"] for w in windows] == list(range(0, len(ref.tokens), 16))
        assert windows[0]["agreement"] == float(recent.agrees[:16].double().mean())
    finally:
        engine.release(prompt)


def test_the_merged_kl_is_exact_over_the_whole_vocabulary_and_a_lower_bound_over_part_of_it():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(3 * torch.randn(5, 50, generator=g, dtype=torch.float64), -1)  # [5, V]
    q = torch.log_softmax(3 * torch.randn(5, 50, generator=g, dtype=torch.float64), -1)
    exact = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)  # [5]
    assert torch.allclose(divergence(p, q), exact)
    for row in range(5):
        top = p[row].topk(8).indices  # [8]
        part = divergence(merged(p[row], top), merged(q[row], top))
        assert 0 < part <= exact[row] + 1e-12
        every = torch.arange(50)  # every outcome named: the rest holds nothing, in either
        assert merged(q[row], every)[-1] == -torch.inf
        assert torch.allclose(divergence(merged(p[row], every), merged(q[row], every)), exact[row])


def test_a_peaked_distribution_keeps_a_finite_divergence():
    """Where the named outcomes hold all but a rounding error of the mass, the rest is the sum of
    the others (tiny, finite), not one minus the named (zero in one, noise in the other)."""
    p = torch.log_softmax(torch.tensor([40.0, 0.0, 0.0, -5.0], dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor([41.0, 0.0, -1.0, -5.0], dtype=torch.float64), -1)
    named = torch.tensor([0, 1])
    part = divergence(merged(p, named), merged(q, named))
    assert torch.isfinite(part) and 0 <= part <= divergence(p, q) + 1e-15


def test_agreement_at_decisive_positions_counts_only_where_the_full_cache_has_a_clear_favourite():
    found = Fidelity(agrees=torch.tensor([True, False, False, True]), kl=torch.tensor([0.0, 1.0, 2.0, 3.0]),
                     decisive=torch.tensor([True, True, False, False]))
    assert found.summary() == {"agreement": 0.5, "kl": 1.5, "decisive_share": 0.5, "decisive_agreement": 0.5,
                               "recall": None}  # not probed
    assert found.summary(2) == {"agreement": 0.5, "kl": 2.5, "decisive_share": 0.0, "decisive_agreement": None,
                                "recall": None}
    assert [w["decisive_agreement"] for w in found.windows(2)] == [0.5, None]
    top = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.3, 0.7]]).log()  # [N, top + 1]: the favourite, then the rest
    assert Reference((1, 2, 3), torch.zeros(3, 1).long(), top).decisive.tolist() == [True, True, False]


def test_the_repeated_share_counts_positions_that_end_a_run_seen_before():
    def share(tokens, size, n=3):
        empty = torch.empty(len(tokens), 1)
        return Reference(tuple(tokens), empty.long(), empty).repeated(size, n)

    assert share(range(12), 4) == [0.0, 0.0, 0.0]  # nothing repeats
    # a 4-token cycle: the runs ending at 4 and 5 cross the first cycle's end (new), from 6 on all repeat
    assert share([1, 2, 3, 4] * 3, 4) == [0.0, 0.5, 1.0]
    assert share([5, 1, 2, 3, 9, 1, 2, 3], 4) == [0.0, 0.25]  # only (1, 2, 3) ends twice
    assert share([7, 7], 4) == [0.0]  # shorter than a run: nothing counted
    assert share([7] * 6, 2, n=1) == [0.5, 1.0, 1.0]  # every token after the first repeats


def test_the_cli_writes_its_report_and_refuses_an_empty_prompt(capsys, smollm2_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    cmd = [sys.executable, "-m", "icekv.cli", "fidelity", "--model", str(smollm2_dir), "--prompt-file", str(prompt),
           "--new-tokens", "24", "--policies", "full,streaming", "--budgets", "48,64", "--window", "8",
           "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--recall", "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    report = (tmp_path / "out" / "report.md").read_text()
    assert [(r["policy"], r["budget"]) for r in results["records"]] == [("full", None), ("streaming", 48),
                                                                         ("streaming", 64)]
    assert results["records"][0]["agreement"] == 1.0 and results["records"][0]["kl"] == 0.0
    assert results["records"][0]["decisive_agreement"] == 1.0 and 0 < results["records"][0]["decisive_share"] <= 1
    assert results["meta"]["sampled"] == {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    assert len(results["meta"]["reference_repeated"]) == 3  # 24 positions in windows of 8
    assert "| streaming | 48 |" in report and "ends a run of 8 tokens that" in report
    assert "## top-1 agreement at the decisive positions" in report and "## selection recall" in report
    assert results["records"][0]["recall"] is None and 0 < results["records"][1]["recall"] <= 1 + 1e-6
    assert "sampled (temperature 0.8, top-p 0.9, seed 5) output" in report
    assert "temperature must be in" in refused(capsys, *cmd[3:], "--temperature", "-1")
    prompt.write_text("  \n")
    err = refused(capsys, *cmd[3:])
    assert "is empty" in err
