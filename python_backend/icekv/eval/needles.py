"""What a retrieval task hides in a context and asks of it: keyed needles ("One of the special magic
numbers for amber-river is: 4821733."), variable chains ("VAR QWERT = VAR ASDFG."), the questions
that ask for them, and how many tokens an answer may need (which sizes the tokens decoded and the
pool). Drawn from a seeded RNG; the templates follow RULER's.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from icekv.errors import ConfigError
from icekv.eval.arith import final_number

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
MULTIVALUE_QUESTION = ("\nWhat are all the special magic numbers for {key} mentioned in the provided text? The "
                       "special magic numbers for {key} mentioned in the provided text are")  # every value of a key
RECALL_ALL_QUESTION = ("\nWhat are all the special magic numbers mentioned in the provided text, each with its key, "
                       "one per line as 'key: number'? The special magic numbers mentioned in the provided text "
                       "are:\n{key}:")  # every needle of a context: a long answer, started with the first one's key


def find_needles(text: str) -> Iterator[re.Match]:
    """Every keyed needle in ``text``, in order; each match's groups are ``key`` and ``value``."""
    pattern = re.escape(NEEDLE).replace(re.escape("{key}"), r"(?P<key>[\w-]+)").replace(re.escape("{value}"), r"(?P<value>\d+)")
    return re.finditer(pattern, text)


VAR_NEEDLE = "VAR {name} = {value}."
VAR_QUESTION = (
    "\nWhich variables are assigned the value {value} in the text above? According to the chain of "
    "variables assigned in the text above, {n} variables are assigned the value {value}, they are:"
)
WORKED_ANSWER_ROOM = 768  # a reasoning written out, then its number (cot_arith)
VALUE_DIGITS = 7  # a needle's value
NAME_LETTERS = 5  # a chain's variable name
# Our own small vocabulary for needle keys ("word-word"), so keys are ordinary tokens.
KEY_WORDS = (
    "amber anchor apple arrow autumn badge basket beacon berry blanket bottle breeze bridge "
    "brook candle canyon carpet castle cedar chimney clover comet copper coral cottage crystal "
    "dawn desert falcon feather fern forest fountain garden glacier granite harbor hazel helmet "
    "island ivory jacket jasmine kettle lantern lemon maple marble meadow mirror mountain needle "
    "orchid otter pebble pepper pillow pine planet quartz rabbit raven ribbon river saddle "
    "salmon silver spruce starling summit thistle thunder timber tulip velvet violet walnut "
    "willow window winter"
).split()


@dataclass(frozen=True)
class Question:
    """One question asked of a context, and the answers it expects."""

    text: str  # follows the context: the question, then its answer prefix
    answers: tuple[str, ...]  # every one must appear in the output
    stop: tuple[str, ...] = ("\n",)  # where the answer ends (a list of names may span lines)
    keys: tuple[str, ...] = ()  # where given, answer i counts only stated as "keys[i]: answer" (the answer's
    # first line starts in the text: its last line comes before the output)
    final: bool = False  # only the output's final number counts (a worked answer states many): cot_arith

    @property
    def answer_room(self) -> int:
        """Tokens the whole answer may take, in characters (a token holds at least one): a value and 4 to
        spare, or a list in its longest usual form, a numbered line per answer after a lead-in (":")."""
        if self.final:
            return WORKED_ANSWER_ROOM
        if len(self.answers) == 1:
            return len(self.answers[0]) + 4
        if self.keys:
            return len("\n".join(f"{i}. {k}: {a}" for i, (k, a) in enumerate(zip(self.keys, self.answers), 1))) + 8
        return len("\n".join(f"{i}. {a}" for i, a in enumerate(self.answers, 1))) + 8

    def tokens_to_decode(self, floor: int) -> int:
        """The token limit its answer is decoded under: its :attr:`answer_room`, at least ``floor``
        (an evaluation's ``max_tokens``)."""
        return max(floor, self.answer_room)

    def score(self, output: str) -> float:
        """1.0 when every expected answer appears in the output (with ``keys``: as ``key: answer``),
        else the share that did."""
        if self.final:
            return float(final_number(output) == int(self.answers[0]))
        if not self.keys:
            return sum(a in output for a in self.answers) / len(self.answers)
        stated = set(re.findall(r"([\w-]+): *(\d+)", self.text.rsplit("\n", 1)[-1] + output))  # (key, value) pairs
        return sum(pair in stated for pair in zip(self.keys, self.answers)) / len(self.answers)


def longest_answer_room(task: str, num_values: int, num_hops: int, num_needles: int) -> int:
    """The most :attr:`Question.answer_room` any question of ``task`` may need: a key's
    ``num_values`` values (niah_multivalue), a chain's ``num_hops`` + 1 names (variable_tracking),
    every one of ``num_needles`` keys and values (recall_all), else one value."""
    if task == "cot_arith":
        return WORKED_ANSWER_ROOM
    if task == "recall_all":
        longest_key = "x" * (2 * max(map(len, KEY_WORDS)) + 1)
        return Question("", ("x" * VALUE_DIGITS,) * num_needles, keys=(longest_key,) * num_needles).answer_room
    answers, width = {"niah_multivalue": (num_values, VALUE_DIGITS),
                      "variable_tracking": (num_hops + 1, NAME_LETTERS)}.get(task, (1, VALUE_DIGITS))
    return Question("", ("x" * width,) * answers).answer_room


def keyed_needles(rng: random.Random, task: str, questions: int, num_needles: int, num_values: int,
                  distinct_words: bool = False) -> tuple[list[str], list[Question]]:
    """The needles' texts (asked ones first, then distractors) and one question per asked key;
    ``recall_all``: ``num_needles`` needles and one question asking for all of them
    (:func:`recall_all_question`, once their order in the text is known).

    Keys are two words of :data:`KEY_WORDS`; by default two keys may share a word ("spruce-timber",
    "timber-comet"), which with this small vocabulary happens in most contexts of several keys and
    makes a key easy to mistake for another. ``distinct_words`` draws every word of a context once,
    as RULER's large vocabulary all but ensures."""
    if distinct_words:
        check_distinct_key_words(task, questions, num_needles)
    keys_used: set[str] = set()
    words_left = list(KEY_WORDS) if distinct_words else None
    values_used: set[str] = set()
    pairs, asked = [], []
    if task == "recall_all":
        pairs = [(_key(rng, keys_used, words_left), _value(rng, values_used)) for _ in range(num_needles)]
        return [NEEDLE.format(key=k, value=v) for k, v in pairs], []
    many = task == "niah_multivalue"  # asks for every value of a key: they may come one a line
    template, stop = (MULTIVALUE_QUESTION, ()) if many else (QUESTION, ("\n",))
    for _ in range(questions):
        key = _key(rng, keys_used, words_left)
        values = [_value(rng, values_used) for _ in range(num_values if many else 1)]
        pairs += [(key, v) for v in values]
        asked.append(Question(template.format(key=key), tuple(values), stop))
    if task == "niah_multikey":
        pairs += [(_key(rng, keys_used, words_left), _value(rng, values_used)) for _ in range(num_needles - questions)]
    return [NEEDLE.format(key=k, value=v) for k, v in pairs], asked


def recall_all_question(text: str) -> Question:
    """The question asking for every needle of ``text``, its answer started with the first
    needle's key (a small model then keeps to the 'key: number' lines the score binds)."""
    found = list(find_needles(text))
    keys, values = tuple(m["key"] for m in found), tuple(m["value"] for m in found)
    return Question(RECALL_ALL_QUESTION.format(key=keys[0]), values, (), keys)


def check_distinct_key_words(task: str, questions: int, num_needles: int) -> None:
    """Refuses a context of more keys than :data:`KEY_WORDS` holds pairs of unused words for."""
    n_keys = num_needles if task in ("niah_multikey", "recall_all") else questions
    if 2 * n_keys > len(KEY_WORDS):
        raise ConfigError(f"--distinct-key-words: {n_keys} keys need {2 * n_keys} words; the key vocabulary has "
                          f"{len(KEY_WORDS)}")


def variable_chains(rng: random.Random, questions: int, num_hops: int) -> tuple[list[str], list[Question]]:
    """Per question a chain of variable assignments from one value; asked: every name in it."""
    names: set[str] = set()
    values_used: set[str] = set()
    needles, asked = [], []
    for _ in range(questions):
        value = str(rng.randrange(10_000, 100_000))
        while value in values_used:
            value = str(rng.randrange(10_000, 100_000))
        values_used.add(value)
        chain = []
        while len(chain) < num_hops + 1:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(NAME_LETTERS))
            if name not in names:
                names.add(name)
                chain.append(name)
        needles.append(VAR_NEEDLE.format(name=chain[0], value=value))
        needles += [VAR_NEEDLE.format(name=b, value=f"VAR {a}") for a, b in zip(chain, chain[1:])]
        asked.append(Question(VAR_QUESTION.format(value=value, n=len(chain)), tuple(chain), stop=()))
    return needles, asked


def _key(rng: random.Random, used: set[str], words_left: list[str] | None) -> str:
    """A key not in ``used``; with ``words_left``, two of those words, taken out of it."""
    if words_left is not None:
        first, second = rng.sample(words_left, 2)
        words_left.remove(first)
        words_left.remove(second)
        used.add(f"{first}-{second}")
        return f"{first}-{second}"
    while True:
        key = f"{rng.choice(KEY_WORDS)}-{rng.choice(KEY_WORDS)}"
        if key not in used:
            used.add(key)
            return key


def _value(rng: random.Random, used: set[str]) -> str:
    while True:
        value = str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10 ** VALUE_DIGITS))
        if value not in used:
            used.add(value)
            return value
