"""Task generation from real text: exact lengths, needles where asked, determinism."""

import pytest

from icekv.errors import ConfigError
from icekv.eval.tasks import TASKS, HaystackSampler

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def sampler(engine, essays_text):
    return HaystackSampler(essays_text, engine.tokenizer)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [500, 2000])
def test_samples_have_the_asked_length_and_their_answers(sampler, task, length):
    s = sampler.make(task, length, seed=3, num_needles=3, num_values=2)
    assert length - 40 <= s.prompt_tokens <= length + 5
    for answer in s.answers:
        assert answer in s.prompt
    assert s.score(" ".join(s.answers)) == 1.0 and s.score("nothing") == 0.0
    if task == "niah_multikey":
        assert s.prompt.count("One of the special magic numbers") == 3 and len(s.answers) == 1
    if task == "niah_multivalue":
        assert len(s.answers) == 2 and s.score(s.answers[0]) == 0.5


def test_same_seed_same_sample_and_depth_is_honoured(sampler):
    a, b = sampler.make("niah_single", 1000, seed=11, depth=0.1), sampler.make("niah_single", 1000, seed=11, depth=0.1)
    assert a.prompt == b.prompt
    c = sampler.make("niah_single", 1000, seed=11, depth=0.9)
    needle_at = lambda s: s.prompt.index("One of the special magic numbers") / len(s.prompt)
    assert needle_at(a) < 0.25 and needle_at(c) > 0.75


def test_bad_task_and_lengths(sampler):
    with pytest.raises(ConfigError, match="unknown task"):
        sampler.make("summarize", 1000, seed=0)
    with pytest.raises(ConfigError, match="too short"):
        sampler.make("niah_single", 50, seed=0)
    with pytest.raises(ConfigError, match="exceeds the haystack"):
        sampler.make("niah_single", 10**7, seed=0)
