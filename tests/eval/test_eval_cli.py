"""`icekv eval` end to end on a small grid, and its refusals."""

import json

import pytest

from tests.test_cli import icekv, refused


@pytest.mark.model
def test_small_eval_writes_results_report_and_plot(tmp_path, smollm2_dir):
    out = tmp_path / "run"
    proc = icekv("eval", "--task", "niah_single", "--lengths", "600", "--policies", "full,streaming,icecache",
                 "--budgets", "64,128", "--samples", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = json.loads((out / "results.json").read_text())["records"]
    keys = {(r["policy"], r["budget"]) for r in records}
    assert keys == {("full", None), ("streaming", 64), ("streaming", 128), ("icecache", 64), ("icecache", 128)}
    for r in records:
        assert r["n"] == 2 and 0 <= r["accuracy"] <= 1 and r["task"] == "niah_single" and r["length"] == 600
        if r["policy"] != "full":
            assert 0 < r["recall"] <= 1 and len(r["layers"]) == 28
            assert r["resident_bytes"] < r["total_bytes"]
    assert "| icecache | 128 |" in (out / "report.md").read_text()
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert "eval" in proc.stderr  # progress bar on stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policies", "full,magic"], "unknown policy"),
        (["--budgets", "32"], "must exceed sink"),
        (["--budgets", "100"], "not a multiple of the page size"),
        (["--task", "summarize"], "--task: unknown task"),
        (["--lengths", "2k"], "--lengths"),
        (["--depths", "1.5"], "--depths"),
        (["--task", "niah_multikey", "--num-needles", "45", "--distinct-key-words"], "45 keys need 90 words"),
    ],
)
def test_bad_eval_flags(capsys, tmp_path, args, message):
    err = refused(capsys, "eval", "--out", str(tmp_path), "--policies", "full,icecache", *args)
    assert message in err


@pytest.mark.model
def test_a_length_too_short_for_the_task_is_refused_on_its_own_line(capsys, tmp_path, smollm2_dir):
    err = refused(capsys, "eval", "--lengths", "10", "--samples", "1", "--out", str(tmp_path))
    last = err.splitlines()[-1]
    assert last.startswith("icekv: error: length 10 is too short for the task")  # its own line, not after the bar


@pytest.mark.model
def test_a_long_run_logs_each_context_and_resumes(capsys, tmp_path, smollm2_dir):
    """Each context's runs are one log line written as it finishes; --resume keeps them and runs
    only what is missing (here the grid grew by a sample), a cut last line runs again, and a
    different grid is refused."""
    out = tmp_path / "run"
    grid = ["--task", "niah_multikey", "--lengths", "600", "--policies", "full,icecache", "--budgets", "64",
            "--questions", "2", "--num-needles", "3", "--out", str(out)]
    proc = icekv("eval", *grid, "--samples", "1")
    assert proc.returncode == 0, proc.stderr
    log = out / "runs.jsonl"
    first = log.read_text().splitlines()
    assert len(first) == 2 and "config" in json.loads(first[0])
    entry = json.loads(first[1])
    assert entry["context"] == "niah_multikey/600/0" and len(entry["runs"]) == 4  # 2 questions x 2 selections
    assert {r["question"] for r in entry["runs"]} == {0, 1}

    log.write_text("\n".join(first) + "\n" + first[1][:50])  # an interrupted write of a second context
    proc = icekv("eval", *grid, "--samples", "2", "--resume")
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[:2] == first  # kept as it was, not run again
    assert [json.loads(line)["context"] for line in lines[2:]] == ["niah_multikey/600/1"]  # the cut line gone
    records = json.loads((out / "results.json").read_text())["records"]
    assert {r["n"] for r in records} == {4} and all(0 <= r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] for r in records)

    assert "different evaluation grid" in refused(capsys, "eval", *grid[:-2], "--budgets", "128", "--out", str(out),
                                                  "--resume")
    assert "does not exist" in refused(capsys, "eval", *grid[:-1], str(tmp_path / "none"), "--resume")


@pytest.mark.model
def test_a_prefix_store_gives_a_later_run_its_contexts_without_prefilling(capsys, tmp_path, smollm2_dir):
    """With --prefix-store each context's KV pages are kept; a second run over the same grid reads
    them back (it prefills only each context's last page) and answers exactly as the first."""
    store = tmp_path / "prefixes"
    grid = ["--task", "niah_multikey", "--lengths", "1200", "--policies", "full,icecache", "--budgets", "64",
            "--questions", "2", "--num-needles", "3", "--samples", "2", "--prefix-store", str(store)]
    runs = []
    for name in ("first", "second"):
        proc = icekv("eval", *grid, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
        lines = [json.loads(line) for line in (tmp_path / name / "runs.jsonl").read_text().splitlines()[1:]]
        runs.append(lines)
        if name == "first":
            whole = sum((e["context_tokens"] - 1) // 16 for e in lines)  # full pages before each last token
            # every one, less the preamble's first page, both contexts' one entry
            assert len(list(store.glob("*.ctx"))) == whole - 1
    answers = [[(r["question"], r["policy"], r["output"]) for r in e["runs"]] for e in runs[0]]
    assert answers == [[(r["question"], r["policy"], r["output"]) for r in e["runs"]] for e in runs[1]]
    assert [e["prefill_cached_tokens"] for e in runs[0]] == [0, 16]  # the second shares the preamble's first page
    assert [e["prefill_cached_tokens"] for e in runs[1]] == [(e["context_tokens"] - 1) // 16 * 16 for e in runs[1]]

    err = refused(capsys, "eval", *grid, "--compress", "kv2", "--out", str(tmp_path / "c"))
    assert "--prefix-store applies to the decode eval" in err


@pytest.mark.model
def test_another_weight_format_never_reads_the_stored_pages(tmp_path):
    """Pages kept by an fp32 run belong to that model: a run under int8 weights prefills its contexts
    again (the store keys entries by the model's identity, which names the weight format)."""
    store = tmp_path / "prefixes"
    grid = ["--task", "niah_single", "--lengths", "600", "--policies", "full", "--samples", "1",
            "--prefix-store", str(store)]
    for name, weights in (("fp32", "auto"), ("int8", "int8"), ("int8_again", "int8")):
        proc = icekv("eval", *grid, "--weights", weights, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
    cached = {name: json.loads((tmp_path / name / "runs.jsonl").read_text().splitlines()[1])["prefill_cached_tokens"]
              for name in ("fp32", "int8", "int8_again")}
    assert cached["fp32"] == cached["int8"] == 0 and cached["int8_again"] > 0
    assert json.loads((tmp_path / "int8" / "results.json").read_text())["meta"]["weights"] == "int8"


@pytest.mark.model
def test_an_interrupted_context_resumes_from_its_next_question(tmp_path, smollm2_dir, essays_text):
    """Each answered question is logged as it finishes; a run stopped inside a context asks it only
    the questions not logged (the same answers as one uninterrupted run), and the finished
    context's one entry replaces its question lines."""
    from icekv.config.engine import EngineConfig
    from icekv.engine import Engine
    from icekv.eval.runner import EvalConfig, run_eval

    class Stop(Exception):
        pass

    engine = Engine(EngineConfig(model_dir=str(smollm2_dir)))
    cfg = EvalConfig(tasks=("niah_multikey",), lengths=(400,), policies=("full", "icecache"), budgets=(64,),
                     samples=1, questions=3, num_needles=4)
    text = essays_text[:40000]
    whole = run_eval(engine, cfg, text, log=tmp_path / "whole.jsonl")
    log = tmp_path / "runs.jsonl"

    def stop_after_four(done, total, resumed):  # 2 questions x 2 selections, then an interruption
        if done == 4:
            raise Stop

    with pytest.raises(Stop):
        run_eval(engine, cfg, text, stop_after_four, log=log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["context"], e.get("question")) for e in lines[1:]] == [("niah_multikey/400/0", 0)]  # q1 cut
    assert engine.cache.pages_available == engine.cache.allocator.num_pages  # the interrupted prefill freed

    calls = []
    resumed = run_eval(engine, cfg, text, lambda *a: calls.append(a), log=log, resume=True)
    assert calls[0] == (2, 6, True) and calls[-1] == (6, 6, False) and len(calls) == 5  # questions 1, 2 run
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2 and "question" not in lines[1]  # one context entry, the question lines gone
    assert sorted((r["question"], r["policy"]) for r in lines[1]["runs"]) == \
        sorted((q, p) for q in range(3) for p in ("full", "icecache"))
    outputs = lambda path: {(r["question"], r["policy"]): r["output"]  # noqa: E731
                            for e in map(json.loads, path.read_text().splitlines()[1:]) for r in e["runs"]}
    assert outputs(log) == outputs(tmp_path / "whole.jsonl")
    assert [r["accuracy"] for r in resumed] == [r["accuracy"] for r in whole]


@pytest.mark.model
def test_a_context_the_pool_cannot_hold_is_refused_before_its_prefill(smollm2_dir, essays_text):
    from icekv.config.engine import EngineConfig
    from icekv.config.paging import PagingConfig
    from icekv.engine import Engine
    from icekv.errors import CacheFullError
    from icekv.eval.runner import EvalConfig, run_eval

    cfg = EvalConfig(lengths=(600,), policies=("full",), samples=1)
    assert cfg.pool_tokens >= 600 + cfg.max_tokens  # what `icekv eval` sizes its pool to
    engine = Engine(EngineConfig(model_dir=str(smollm2_dir), paging=PagingConfig(pool_tokens=608)))
    with pytest.raises(CacheFullError, match="exceeds the KV cache capacity"):
        run_eval(engine, cfg, essays_text[:20000])
    assert engine.cache.pages_available == engine.cache.allocator.num_pages  # nothing was prefilled


@pytest.mark.model
def test_progress_tells_kept_contexts_from_run_ones(tmp_path, smollm2_dir, essays_text):
    """A resumed run reports the contexts kept from its log as such (the bar leaves them out of
    its rate, else a resumed run of hours would show an ETA of seconds)."""
    from icekv.config.engine import EngineConfig
    from icekv.engine import Engine
    from icekv.eval.runner import EvalConfig, run_eval

    engine = Engine(EngineConfig(model_dir=str(smollm2_dir)))
    log = tmp_path / "runs.jsonl"
    grid = dict(tasks=("niah_multikey",), lengths=(400,), policies=("full",), questions=2, num_needles=3)
    run_eval(engine, EvalConfig(samples=1, **grid), essays_text[:40000], log=log)
    calls = []
    run_eval(engine, EvalConfig(samples=2, **grid), essays_text[:40000], lambda *a: calls.append(a), log=log,
             resume=True)
    assert calls == [(2, 4, True), (3, 4, False), (4, 4, False)]


def test_a_bare_prefix_store_flag_names_the_cache_directory(tmp_path, monkeypatch):
    from icekv.cli import build_parser

    monkeypatch.setenv("ICEKV_CACHE", str(tmp_path))
    parse = build_parser().parse_args
    assert parse(["eval", "--prefix-store", "--out", "o"]).prefix_store == str(tmp_path / "eval-prefixes")
    assert parse(["eval", "--prefix-store", "/s", "--out", "o"]).prefix_store == "/s"
    assert parse(["eval", "--out", "o"]).prefix_store is None
