"""icekv inside a real vLLM (the CPU build, in its own environment: `make setup-vllm`): the plugin
registers and vLLM runs it; vLLM's tokens are icekv's own engine's under the same plan; batched,
preempted, aborted and prefix-sharing requests keep their own indexes, released as they end and
continued by a request that continues their tokens; bad settings get vLLM's validation error. One
vLLM start for the module (tests/vllm/run_in_vllm.py, the embedded SmolLM2 in fp32)."""

import json
import subprocess
from pathlib import Path

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from tests.vllm.run_in_vllm import LONG_NEW_TOKENS

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: `make setup-vllm` makes it")]
PLANS = {"full": SelectionConfig(policy="full"), "icecache": SelectionConfig(policy="icecache", budget=128),
         "quest": SelectionConfig(policy="quest", budget=128)}


@pytest.fixture(scope="module")
def prompts(engine, essays_text):
    ids = engine.tokenizer.encode(essays_text)
    return {"short": [ids[:700], ids[5000:5600], ids[9000:9500]],  # each past the budget: decodes select
            "long": [ids[12000:12960], ids[15000:15960]],  # 30 blocks each: together they outgrow the cache
            "extended": ids[:700] + ids[800:850]}  # the first short prompt's blocks, from vLLM's prefix cache


@pytest.fixture(scope="module")
def vllm_run(smollm2_dir, prompts):
    proc = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("run_in_vllm.py")), str(smollm2_dir),
                           json.dumps(prompts)], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("{")]  # vLLM logs around it
    return json.loads(line)


def test_vllm_runs_icekvs_backend(vllm_run):
    assert vllm_run["backend"] == "icekv.vllm.backend.IceKVCPUBackend"
    assert [s["builders"] for s in vllm_run["stats"]] == [1]  # the worker found icekv's builder


def test_a_budget_covering_the_context_is_vllms_own_attention(vllm_run, engine, prompts):
    assert vllm_run["wide"] == vllm_run["full"]
    mine = engine.generate(prompts["short"][0], SamplingConfig(max_tokens=16, ignore_eos=True), selection=PLANS["full"])
    assert vllm_run["full"] == mine.token_ids  # vLLM's kernel and icekv's engine agree in fp32


@pytest.mark.parametrize("name", ["icecache", "quest"])
def test_inside_vllm_a_method_decodes_what_icekvs_engine_decodes(vllm_run, engine, prompts, name):
    mine = engine.generate(prompts["short"][0], SamplingConfig(max_tokens=16, ignore_eos=True), selection=PLANS[name])
    assert vllm_run[name] == mine.token_ids
    assert vllm_run[name] != vllm_run["full"]  # the budget selected: these are not full attention's tokens


def test_batched_requests_keep_their_own_indexes_and_release_them(vllm_run):
    assert vllm_run["batched"][0] == vllm_run["icecache"] and vllm_run["batched"][1:] == vllm_run["alone"]
    stats = vllm_run["stats"][0]
    assert stats["selecting_steps"] > 0 and stats["indexes"] == 0 and stats["index_bytes"] == 0
    assert stats["kept_indexes"] > 0 and stats["kept_index_bytes"] > 0  # released, kept for a next turn


def test_icekv_reads_what_vllms_cache_writer_wrote_for_every_isa(vllm_run):
    assert len(vllm_run["layouts"]) == 4 and all(vllm_run["layouts"].values()), vllm_run["layouts"]


def test_settings_icekv_cannot_run_get_vllms_validation_error(vllm_run):
    refused = vllm_run["refused"]
    assert "unknown policy 'magic'" in refused["unknown policy"]
    assert "budget must be >= 1" in refused["budget 0"]
    assert "not a multiple of the page size" in refused["budget off the page size"]
    assert "not available inside vLLM" in refused["not inside vLLM"]
    assert all(error.startswith("VLLMValidationError") for error in refused.values())


def test_a_preempted_request_continues_its_released_index_and_the_other_keeps_its_own(vllm_run):
    run = vllm_run["preempted"]
    stats, before = run["stats"], run["before"]
    assert stats["preemptions"] - before["preemptions"] == 1
    assert stats["indexes_built"] - before["indexes_built"] == 2  # one each
    assert stats["indexes_continued"] - before["indexes_continued"] == 1  # the preempted one's, resumed
    assert stats["indexes"] == 0
    kept, preempted = run["together"]
    assert kept == run["alone"][0]  # never lost its blocks: its index saw only its own rows
    # each holds 31 blocks once decoding starts (62 of the 63 usable); at their 33rd token both need
    # one more, and vLLM preempts the later request. Resumed, it recomputes its generated tokens' KV
    # under full attention, so it decodes its own tokens up to there and may part from them after
    assert len(preempted) == LONG_NEW_TOKENS and preempted[:32] == run["alone"][1][:32]


def test_an_aborted_request_releases_its_index(vllm_run):
    during, after = vllm_run["aborted"]["during"], vllm_run["aborted"]["after"]
    assert during["indexes"] == 1 and during["index_bytes"] > 0
    assert after["indexes"] == 0 and after["index_bytes"] == 0


def test_a_prefix_cache_hit_continues_the_index_an_earlier_request_released(vllm_run, engine, prompts):
    """The extended prompt starts with the first short prompt's tokens: under each plan it takes over
    the index the first prompt's request released and inserts only its new pages. Quest's page
    bounds are the same whether built at once or page by page, so its tokens are icekv's engine's."""
    hit, before = vllm_run["prefix_hit"], vllm_run["prefix_hit"]["before"]
    assert hit["cached"] >= 640  # the first short prompt's 21 full blocks, computed by an earlier request
    assert hit["stats"]["indexes_continued"] - before["indexes_continued"] == 2  # icecache's and quest's
    assert hit["stats"]["indexes_built"] == before["indexes_built"] and hit["stats"]["indexes"] == 0
    sampling = SamplingConfig(max_tokens=16, ignore_eos=True)
    assert hit["quest"] == engine.generate(prompts["extended"], sampling, selection=PLANS["quest"]).token_ids
    # IceCache's tokens are not compared: its DCI-trees differ built at once or page by page, and
    # vLLM's keys are not bit for bit icekv's, so a near tie between two pages may go either way
