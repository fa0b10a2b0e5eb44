"""Task generation from real text: exact lengths, needles where asked, determinism."""

import re

import pytest

from icekv.errors import ConfigError
from icekv.eval.needles import find_needles
from icekv.eval.runner import EvalConfig
from icekv.eval.tasks import TASKS, HaystackSampler

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def sampler(engine, essays_text):
    return HaystackSampler(essays_text, engine.tokenizer)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [500, 2000])
def test_samples_have_the_asked_length_and_their_answers(sampler, task, length):
    s = sampler.make(task, length, seed=3, num_needles=3, num_values=2)
    q = s.question
    assert length - 40 <= s.prompt_tokens <= length + 5
    for answer in q.answers if task != "cot_arith" else ():  # a worked answer is computed, not found
        assert answer in s.prompt
    truth = " ".join(q.answers)
    if task == "recall_all":  # a line per needle, its key first (the first key is the answer prefix's)
        truth = " " + "\n".join(f"{k}: {v}" for k, v in zip(q.keys, q.answers))[len(q.keys[0]) + 1:]
    assert s.score(truth) == 1.0 and s.score("nothing") == 0.0
    if task == "niah_multikey":
        assert s.prompt.count("One of the special magic numbers") == 3 and len(q.answers) == 1
    if task == "niah_multivalue":
        assert len(q.answers) == 2 and s.score(q.answers[0]) == 0.5


def test_recall_all_asks_every_needle_and_scores_each_value_only_on_its_keys_line(sampler):
    s = sampler.make("recall_all", 3000, seed=7, num_needles=16)
    again = sampler.make("recall_all", 3000, seed=7, num_needles=16)
    assert s == again and s != sampler.make("recall_all", 3000, seed=8, num_needles=16)  # seeded
    q = s.question
    found = list(find_needles(s.prompt))
    assert [(m["key"], m["value"]) for m in found] == list(zip(q.keys, q.answers))  # every needle, in text order
    assert len(set(q.keys)) == 16 and s.prompt.endswith(f"are:\n{q.keys[0]}:")  # the first key starts the answer
    lines = [f"{k}: {v}" for k, v in zip(q.keys, q.answers)]
    truth = "\n".join(lines)[len(q.keys[0]) + 1:]
    assert s.score(truth) == 1.0
    assert s.score("\n".join(lines[:8])[len(q.keys[0]) + 1:]) == 0.5  # cut off halfway
    swapped = [f"{k}: {v}" for k, v in zip(q.keys, q.answers[1:] + q.answers[:1])]  # every value, wrong key
    assert s.score("\n".join(swapped)[len(q.keys[0]) + 1:]) == 0.0
    assert s.score(" ".join(q.answers)) == 1 / 16  # the values alone: only the first follows its key
    crossed = f" {q.answers[1]}, {q.keys[1]}: {q.answers[0]}"  # both keys and values on one line, crossed
    assert s.score(crossed) == 0.0
    with pytest.raises(ConfigError, match="recall_all and cot_arith: 1"):
        sampler.make_context("recall_all", 3000, seed=7, questions=2, num_needles=16)


def test_cot_arith_scatters_its_facts_in_order_and_scores_the_final_number(sampler):
    import random

    from icekv.eval.arith import arith_problem, final_number

    c = sampler.make_context("cot_arith", 3000, seed=4, num_hops=6)
    assert c == sampler.make_context("cot_arith", 3000, seed=4, num_hops=6)  # seeded
    question = c.questions[0]
    facts = re.findall(r"(?:At the start of the week,|Then) [^.]*\.", c.context)
    assert tuple(facts) == arith_problem(random.Random(4), 6).facts and len(c.depths) == 7  # all, in order
    first, last = c.context.index(facts[0]), c.context.rindex(facts[-1])
    assert last - first > len(c.context) // 4  # spread through the text
    answer = question.answers[0]
    assert question.score(f"First 3 + 4 = 7. Then 7 * 2 = 14. The answer is {answer}.") == 1.0
    assert question.score(f"{answer} at first, but then 5.") == 0.0  # only the final number counts
    assert question.score("The answer is 9999.") == 0.0 and question.score("no number") == 0.0
    assert final_number("The answer is: **1,234**.") == 1234
    alone = sampler.make_context("cot_arith", 0, seed=4, num_hops=6)  # no room for text: the problem alone
    assert alone.depths == () and alone.questions == c.questions and len(alone.context) < 600
    with pytest.raises(ConfigError, match="recall_all and cot_arith: 1"):
        sampler.make_context("cot_arith", 3000, seed=4, questions=2)


def test_cot_arith_answers_follow_their_facts():
    import random

    from icekv.eval.arith import arith_problem

    for seed in range(200):
        problem = arith_problem(random.Random(seed), 8)
        count = int(re.search(r"has (\d+)", problem.facts[0]).group(1))
        for fact in problem.facts[1:]:  # replay the facts as a reader would
            n = int(m.group(1)) if (m := re.search(r"(\d+)", fact)) else None
            count = (count + n if "buys" in fact else count - n if "to a friend" in fact else count // 2
                     if "half" in fact else count * 2 if "doubles" in fact else count * 3)
            assert 1 <= count <= 200
        assert count == problem.answer


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


def test_chat_prompt_format_puts_the_question_in_a_user_turn(engine, sampler):
    from icekv.eval.tasks import PromptFormat

    s = sampler.make("niah_single", 500, seed=5)
    assert PromptFormat().prompt(s.prompt) == s.prompt  # raw: unchanged
    chat = PromptFormat.from_chat_template(engine.chat_prompt)
    ask, answer_prefix = s.prompt.rsplit("? ", 1)
    expected = engine.chat_prompt([{"role": "user", "content": ask + "?"}]) + answer_prefix
    assert chat.prompt(s.prompt) == expected
    assert expected.endswith("<|im_start|>assistant\nThe special magic number for " + answer_prefix.split(" for ")[1])
    context, question = s.prompt[: s.prompt.rindex("\nWhat")], s.prompt[s.prompt.rindex("\nWhat"):]
    assert chat.context(context) + chat.question(question) == expected  # the reusable split composes


def test_a_template_without_the_user_content_is_refused():
    from icekv.eval.tasks import PromptFormat

    with pytest.raises(ConfigError, match="exactly once"):
        PromptFormat.from_chat_template(lambda messages: "no content here")


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"])
def test_a_context_asks_each_of_its_needles_once(sampler, task):
    c = sampler.make_context(task, 2000, seed=4, questions=3, num_needles=5, num_values=2, num_hops=3)
    assert len(c.questions) == 3 and len({q.text for q in c.questions}) == 3
    answers = [a for q in c.questions for a in q.answers]
    assert len(answers) == len(set(answers)) and all(a in c.context for a in answers)
    length = len(sampler.tokenizer.encode(c.context + c.questions[0].text))
    assert 2000 - 40 <= length <= 2005
    needles = {"niah_single": 3, "niah_multikey": 5, "niah_multivalue": 6, "variable_tracking": 12}[task]
    pattern = r"VAR [A-Z]{5} = " if task == "variable_tracking" else r"One of the special magic numbers for "
    assert len(re.findall(pattern, c.context)) == needles
    assert len(c.depths) == needles
    if task != "variable_tracking":  # every needle is found again, its values among them
        found = [m["value"] for m in find_needles(c.context)]
        assert len(found) == needles and set(answers) <= set(found)
    for q in c.questions:
        assert q.score(" ".join(q.answers)) == 1.0 and q.score("none") == 0.0
        listed = sampler.tokenizer.encode(" " + ", ".join(q.answers) + ".")
        assert len(listed) <= q.answer_room  # the whole answer fits the tokens decoded for it
        grid = EvalConfig(tasks=(task,), num_values=2, num_hops=3)
        assert q.answer_room <= grid.answer_tokens  # the pool a grid sizes holds every answer
        assert q.tokens_to_decode(1) == q.answer_room and q.tokens_to_decode(999) == 999  # a floor, not a cap
        if task in ("niah_single", "niah_multikey"):
            assert grid.answer_tokens == EvalConfig.max_tokens  # one value: the default limit holds
        if task == "niah_multivalue":  # asked for every value of its key, not for one
            assert "What are all the special magic numbers" in q.text and len(q.answers) == 2
            numbered = sampler.tokenizer.encode(":\n" + "\n".join(f"{i}. {a}" for i, a in enumerate(q.answers, 1)))
            assert q.stop == () and len(numbered) <= q.answer_room  # a numbered list is not cut short
        if task == "variable_tracking":  # the chain's statements come in order, from its value on
            value = q.text.split("the value ")[1].split(" ")[0]
            at = [c.context.index(f"VAR {q.answers[0]} = {value}.")]
            at += [c.context.index(f"VAR {b} = VAR {a}.") for a, b in zip(q.answers, q.answers[1:])]
            assert at == sorted(at) and q.stop == ()


def test_keys_share_words_unless_asked_not_to(sampler):
    """By default two keys of a context may share a word (the contexts logged so far were drawn so);
    with distinct_key_words every word of a context's keys is used once."""
    def words(distinct: bool, seed: int) -> list[str]:
        c = sampler.make_context("niah_multikey", 1500, seed=seed, questions=8, num_needles=10,
                                 distinct_key_words=distinct)
        return [w for m in find_needles(c.context) for w in m["key"].split("-")]

    assert any(len(set(words(False, seed))) < 20 for seed in range(5))  # 20 words of 80: shared in most contexts
    for seed in range(5):
        drawn = words(True, seed)
        assert len(drawn) == 20 and len(set(drawn)) == 20
    assert words(True, 3) == words(True, 3) and words(True, 3) != words(True, 4)  # seeded


def test_distinct_key_words_refuse_more_keys_than_the_vocabulary_holds(sampler):
    with pytest.raises(ConfigError, match="--distinct-key-words: 41 keys need 82 words"):
        sampler.make_context("niah_multikey", 4000, seed=0, questions=1, num_needles=41, distinct_key_words=True)


def test_a_context_refuses_what_it_cannot_ask(sampler):
    with pytest.raises(ConfigError, match="unknown context task"):
        sampler.make_context("passkey", 1000, seed=0, questions=2)
    with pytest.raises(ConfigError, match="questions must be >= 1"):
        sampler.make_context("niah_single", 1000, seed=0, questions=0)
