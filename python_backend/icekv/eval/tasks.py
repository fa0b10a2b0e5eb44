"""RULER-style retrieval tasks built from real prose with a seeded RNG.

A sample is a prompt (haystack with needles inserted at chosen depths, then the question) and the
expected answers. Wording follows RULER's needle-in-a-haystack templates, which a 135M model can
follow; lengths are measured in tokens of the model's own tokenizer. What a context hides and
asks (needles, chains, questions) is :mod:`icekv.eval.needles`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from icekv.errors import ConfigError
from icekv.eval.arith import ARITH_PREAMBLE, arith_problem
from icekv.eval.needles import (QUESTION, Question, find_needles, keyed_needles, recall_all_question,
                                variable_chains)
from icekv.model import Tokenizer

PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
PASSKEY_PREAMBLE = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it "
                    "and memorize it. I will quiz you about it afterwards.\n")
PASSKEY_FILLER = "The river runs to the sea. The hills are quiet. The day is long. On we go. "
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
QUESTION_ROOM = 512  # tokens a context's prompt may run past its length (a question, a chat template's tail)
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "passkey", "recall_all", "cot_arith")


@dataclass(frozen=True)
class ContextSample:
    """A context (preamble and haystack with its needles) and the questions asked of it, each
    answered from the same prefilled context."""

    task: str
    context: str
    questions: tuple[Question, ...]
    depths: tuple[float, ...]  # of every needle, in 0..1


@dataclass(frozen=True)
class Sample:
    """A context with one question, as one prompt."""

    task: str
    prompt: str  # ends with the question's text
    question: Question
    depths: tuple[float, ...]
    prompt_tokens: int

    def score(self, output: str) -> float:
        return self.question.score(output)


class HaystackSampler:
    """Cuts token-exact stretches of a haystack and inserts needles at sentence boundaries."""

    def __init__(self, text: str, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = re.sub(r"[ \t]+", " ", text)
        self.ids = tokenizer.encode(self.text)

    def make(self, task: str, length: int, seed: int, depth: float | None = None, num_needles: int = 1,
             num_values: int = 1) -> Sample:
        """One prompt of about ``length`` tokens asking one question (:meth:`make_context`'s first)."""
        if task not in TASKS:
            raise ConfigError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        if task == "passkey":
            return self._passkey(length, random.Random(seed), depth)
        c = self.make_context(task, length, seed, 1, depth, num_needles, num_values)
        prompt = c.context + c.questions[0].text
        return Sample(task, prompt, c.questions[0], c.depths, len(self.tokenizer.encode(prompt)))

    def make_context(self, task: str, length: int, seed: int, questions: int = 1, depth: float | None = None,
                     num_needles: int = 1, num_values: int = 1, num_hops: int = 4,
                     distinct_key_words: bool = False) -> ContextSample:
        """A context of about ``length`` tokens (with a question) and ``questions`` questions of it.

        ``niah_single``: one needle per question, each with its own key; ``niah_multikey``: as many,
        plus distractors up to ``num_needles`` in all, never asked; ``niah_multivalue``: per question
        one key with ``num_values`` values, all asked; ``variable_tracking``: per question a chain of
        ``num_hops`` + 1 variables (``VAR A = 12345.``, ``VAR B = VAR A.``, ...) in order through the
        text, every name asked; ``recall_all``: ``num_needles`` needles, one question asking for
        every one of them with its key (a long answer, decoded with its earlier lines in the cache).
        ``depth`` places a lone needle; otherwise depths come from the seed.
        ``distinct_key_words``: no two keys share a word (:func:`icekv.eval.needles.keyed_needles`).
        """
        if task not in TASKS or task == "passkey":
            choices = ", ".join(t for t in TASKS if t != "passkey")
            raise ConfigError(f"unknown context task {task!r}; choose from {choices}")
        if questions < 1 or (task in ("recall_all", "cot_arith") and questions != 1):
            raise ConfigError(f"questions must be >= 1 (recall_all and cot_arith: 1), got {questions}")
        rng = random.Random(seed)
        if task == "cot_arith":
            return self._arith_context(length, rng, num_hops)
        if task == "variable_tracking":
            needles, asked = variable_chains(rng, questions, num_hops)
        else:
            needles, asked = keyed_needles(rng, task, questions, num_needles, num_values, distinct_key_words)
        n_needles = len(needles)
        if task == "variable_tracking":  # each chain's statements in order through the text
            drawn, size = [rng.random() for _ in needles], num_hops + 1
            depths = [d for j in range(0, n_needles, size) for d in sorted(drawn[j : j + size])]
        else:
            depths = [depth if depth is not None else rng.random()] if n_needles == 1 else [rng.random() for _ in needles]
            if n_needles > 1:
                rng.shuffle(needles)
        question = asked[0].text if asked else recall_all_question(" ".join(needles)).text
        overhead = len(self.tokenizer.encode(PREAMBLE + " ".join(needles) + question)) + 2
        budget = length - overhead
        if budget < 64:
            raise ConfigError(f"length {length} is too short for the task ({overhead} tokens of needles and question)")
        if budget > len(self.ids):
            raise ConfigError(f"length {length} exceeds the haystack ({len(self.ids)} tokens)")
        start = rng.randrange(0, len(self.ids) - budget + 1)
        context = self.tokenizer.decode(self.ids[start : start + budget])
        for needle, d in sorted(zip(needles, depths), key=lambda x: -x[1]):
            context = _insert_at_sentence(context, needle, d)
        if task == "recall_all":
            asked = [recall_all_question(context)]  # in the order the text holds them
        return ContextSample(task, PREAMBLE + context, tuple(asked), tuple(depths))

    def _arith_context(self, length: int, rng: random.Random, steps: int) -> ContextSample:
        """A word problem of ``steps`` changes after its start, its facts in order at random depths
        of a ``length``-token context; the problem alone where ``length`` leaves no room for text."""
        problem = arith_problem(rng, steps)
        asked = (Question(problem.question, (str(problem.answer),), (), final=True),)
        overhead = len(self.tokenizer.encode(ARITH_PREAMBLE + " ".join(problem.facts) + problem.question)) + 2
        budget = length - overhead
        if budget < 64:
            return ContextSample("cot_arith", ARITH_PREAMBLE + " ".join(problem.facts), asked, ())
        if budget > len(self.ids):
            raise ConfigError(f"length {length} exceeds the haystack ({len(self.ids)} tokens)")
        start = rng.randrange(0, len(self.ids) - budget + 1)
        depths = sorted(rng.random() for _ in problem.facts)
        context = _insert_in_order(self.tokenizer.decode(self.ids[start : start + budget]), problem.facts, depths)
        return ContextSample("cot_arith", ARITH_PREAMBLE + context, asked, tuple(depths))

    def _passkey(self, length: int, rng: random.Random, depth: float | None) -> Sample:
        value = str(rng.randrange(10_000, 100_000))
        depth = depth if depth is not None else rng.random()
        needle = PASSKEY_NEEDLE.format(value=value)
        fixed = len(self.tokenizer.encode(PASSKEY_PREAMBLE + needle + PASSKEY_QUESTION))
        per_filler = len(self.tokenizer.encode(PASSKEY_FILLER * 10)) / 10
        n = max(int((length - fixed) / per_filler), 1)
        at = round(n * depth)
        prompt = PASSKEY_PREAMBLE + PASSKEY_FILLER * at + needle + PASSKEY_FILLER * (n - at) + PASSKEY_QUESTION
        tokens = len(self.tokenizer.encode(prompt))
        return Sample("passkey", prompt, Question(PASSKEY_QUESTION, (value,)), (depth,), tokens)


@dataclass(frozen=True)
class ReusableSample:
    """One context with several needles, and one question per needle (asked after it)."""

    context: str
    questions: tuple[tuple[str, str], ...]  # (question text, expected answer)
    context_tokens: int


REUSABLE_TASKS = ("niah_single", "niah_multikey")


def make_reusable(sampler: HaystackSampler, length: int, seed: int, num_questions: int = 4,
                  task: str = "niah_multikey") -> ReusableSample:
    """A context compressed once, then asked several questions. ``niah_multikey``: ``num_questions``
    needles with distinct keys, each asked once; ``niah_single``: one needle, asked once (every
    question is then a context of its own)."""
    if task not in REUSABLE_TASKS:
        raise ConfigError(f"unknown reusable-context task {task!r}; choose from {', '.join(REUSABLE_TASKS)}")
    sample = sampler.make(task, length, seed, num_needles=num_questions if task == "niah_multikey" else 1)
    context = sample.prompt[: sample.prompt.rindex(QUESTION.split("{")[0])]
    questions = tuple((QUESTION.format(key=m["key"]), m["value"]) for m in find_needles(context))
    return ReusableSample(context, questions, len(sampler.tokenizer.encode(context)))


@dataclass(frozen=True)
class PromptFormat:
    """How a task's text reaches the model: as is, or as one user turn of the model's chat template.

    A question ends with its answer prefix ("...? The special magic number for k ... is"); in chat
    form the question goes in the user turn and the answer prefix after the assistant's header, as
    RULER prompts chat models. ``head`` and ``tail`` are the template's text around the user's content.
    """

    head: str = ""
    tail: str = ""

    @property
    def chat(self) -> bool:
        return bool(self.head or self.tail)

    @classmethod
    def from_chat_template(cls, chat_prompt: Callable[[list], str]) -> "PromptFormat":
        """``chat_prompt``: messages -> prompt text (Engine.chat_prompt)."""
        marker = "\u2063icekv-user-content\u2063"
        text = chat_prompt([{"role": "user", "content": marker}])
        if text.count(marker) != 1:
            raise ConfigError("the chat template does not place the user's content exactly once")
        head, tail = text.split(marker)
        return cls(head, tail)

    def context(self, text: str) -> str:
        """The reusable part: the template's head, then ``text``."""
        return self.head + text

    def question(self, text: str) -> str:
        """What follows the context: the question, the template's tail, the answer prefix."""
        if not self.chat:
            return text
        cut = text.rindex("? ") + 1
        return text[:cut] + self.tail + text[cut + 1:]

    def prompt(self, text: str) -> str:
        """A whole task prompt (context and question)."""
        return self.head + self.question(text) if self.chat else text


def _insert_in_order(text: str, items: tuple[str, ...], depths: list[float]) -> str:
    """``items`` inserted at the sentence boundaries nearest to their ascending ``depths``, in
    their order (every boundary found in the text before any insertion)."""
    bounds = [0] + [m.end() for m in re.finditer(r"[.!?]\s", text)] + [len(text)]
    at = [min(bounds, key=lambda b: abs(b - int(len(text) * d))) for d in depths]  # non-decreasing
    for item, where in reversed(list(zip(items, at))):
        text = text[:where] + item + " " + text[where:]
    return text


def _insert_at_sentence(text: str, needle: str, depth: float) -> str:
    """Insert ``needle`` at the sentence boundary nearest to ``depth`` (0 = start, 1 = end)."""
    return _insert_in_order(text, (needle,), [depth])
