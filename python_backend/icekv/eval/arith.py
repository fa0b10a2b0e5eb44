"""Arithmetic word problems answered with the reasoning written out (the ``cot_arith`` task), in
GSM8K's style: a seeded chain of small-integer steps about one person's things, one sentence a
step, and a question for the final count. Every step's sentence is a fact the answer must use,
so with the facts scattered through a long context the reasoning reaches back into it while
the answer grows. Scored on the answer's final number only: a worked answer states many.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

NAMES = ("Ana", "Ben", "Chloe", "Dev", "Ema", "Farid", "Gia", "Hugo", "Ines", "Jon")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "shells", "pencils", "cards", "stamps", "buttons")
ARITH_PREAMBLE = "The facts of a word problem are given in the following text, in the order they happen.\n"
ARITH_QUESTION = ("\nWork it out from the facts above and end with 'The answer is N.': how many {item} does {name} "
                  "have at the end? Let's think step by step.")  # the last sentence: the answer's start
MOST = 200  # no count grows past this: small integers


@dataclass(frozen=True)
class ArithProblem:
    facts: tuple[str, ...]  # in the order they happen: the first sets the count, each other changes it
    question: str
    answer: int


def arith_problem(rng: random.Random, steps: int) -> ArithProblem:
    """A start and ``steps`` changes (buys, gives away, doubles or triples, halves), each kept to
    whole counts in 1..MOST."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(5, 30)
    facts = [f"At the start of the week, {name} has {count} {item}."]
    for _ in range(steps):
        changes = []
        if count + 2 <= MOST:
            changes.append(("buys", rng.randint(2, min(20, MOST - count))))
        if count > 3:
            changes.append(("gives", rng.randint(2, count - 1)))
        if count * 2 <= MOST:
            changes.append(("doubles", 2))
        if count * 3 <= MOST and count <= 20:
            changes.append(("triples", 3))
        if count % 2 == 0:
            changes.append(("halves", 2))
        kind, n = rng.choice(changes)
        if kind == "buys":
            count += n
            facts.append(f"Then {name} buys {n} more {item}.")
        elif kind == "gives":
            count -= n
            facts.append(f"Then {name} gives {n} {item} to a friend.")
        elif kind == "halves":
            count //= 2
            facts.append(f"Then {name} gives away half of the {item}.")
        else:
            count *= n
            facts.append(f"Then the number of {item} {name} has {kind}.")
    return ArithProblem(tuple(facts), ARITH_QUESTION.format(item=item, name=name), count)


def final_number(output: str) -> int | None:
    """The number an answer ends on: the one after its last "answer is", else its last integer."""
    stated = re.findall(r"answer is:?\s*\**\s*(-?\d[\d,]*)", output, re.IGNORECASE)
    numbers = stated or re.findall(r"-?\d[\d,]*", output)
    return int(numbers[-1].replace(",", "")) if numbers else None
