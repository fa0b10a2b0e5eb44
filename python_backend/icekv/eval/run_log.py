"""A long evaluation's log: the grid it runs, then one JSON line per finished context.

A run of hours writes each context as it finishes, so it can be read while it runs and resumed
after an interruption without redoing a finished context. A resumed run must come from the same
grid (the fields that decide what a context holds); only the grid's extent may grow.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from icekv.errors import ConfigError
from icekv.eval.tasks import QUESTION_ROOM


class ContextGrid:
    """What both evaluation grids (dataclasses with ``tasks``, ``lengths``, ``samples`` and
    ``max_tokens``) derive alike: the contexts they run and the pool one context needs."""

    @property
    def answer_tokens(self) -> int:
        """The most tokens an answer of the grid is decoded to."""
        return self.max_tokens

    @property
    def pool_tokens(self) -> int:
        """KV pool capacity one context needs: its length, a question's overshoot and the answer."""
        return max(self.lengths) + QUESTION_ROOM + self.answer_tokens

    def contexts(self) -> list[tuple[str, int, int]]:
        """Every (task, length, sample) of the grid, in the order they run."""
        return [(t, n, i) for t in self.tasks for n in self.lengths for i in range(self.samples)]


def context_key(task: str, length: int, sample: int) -> str:
    """A context's key in the log."""
    return f"{task}/{length}/{sample}"


def grid_of(cfg, growable: tuple[str, ...]) -> dict:
    """``cfg``'s fields as JSON, less ``growable`` (those a resumed run may change)."""
    grid = asdict(cfg)
    for name in growable:
        grid.pop(name)
    return json.loads(json.dumps(grid))


class RunLog:
    """``path`` (None: no log) of a run over ``grid``; entries are keyed by their ``context``.

    A context of hours may also log each question as it is answered (:meth:`append_question`):
    a resumed run then asks that context only the questions not yet logged. Its entry, once
    appended, replaces those question lines."""

    def __init__(self, path: Path | None, grid: dict, defaults: dict | None = None):
        """``defaults``: the grid's fields at their default values. A log written before a field
        existed ran at its default, and resumes where the grid keeps it there."""
        self.path, self.grid, self.defaults = path, grid, defaults or {}
        self._finished: dict[str, dict] = {}
        self._asked: dict[str, dict[int, list[dict]]] = {}  # unfinished context -> question -> its runs

    def start(self, resume: bool) -> dict[str, dict]:
        """The finished entries kept (``resume``) or none; the log is rewritten to hold just them
        and the questions of unfinished contexts, so that a line an interruption cut is dropped,
        not appended to."""
        if resume and self.path is not None and self.path.exists():
            self._finished, self._asked = self._read()
        self._rewrite()
        return dict(self._finished)

    def asked(self, context: str) -> dict[int, list[dict]]:
        """The questions of an unfinished ``context`` a resumed log holds: question -> its runs."""
        return self._asked.get(context, {})

    def append_question(self, context: str, question: int, runs: list[dict]) -> None:
        self._asked.setdefault(context, {})[question] = runs
        self._write_line(_question_line(context, question, runs))

    def append(self, entry: dict) -> None:
        """A finished context's entry; its question lines, if any, leave the log."""
        self._finished[entry["context"]] = entry
        if self._asked.pop(entry["context"], None):
            self._rewrite()
        else:
            self._write_line(entry)

    def _write_line(self, entry: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _rewrite(self) -> None:
        """The log as the grid, the finished entries and the logged questions of unfinished ones,
        replaced at once (an interruption leaves the old log or the new, whole)."""
        if self.path is None:
            return
        lines = [{"config": self.grid}, *self._finished.values()]
        lines += [_question_line(c, q, runs) for c, qs in self._asked.items() for q, runs in qs.items()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in lines))
        os.replace(tmp, self.path)

    def _same_grid(self, stored: dict | None) -> bool:
        """Whether a log's grid is this run's, fields it lacks read at their defaults."""
        if stored is None:
            return False
        missing = {k: v for k, v in self.defaults.items() if k in self.grid and k not in stored}
        return {**missing, **stored} == self.grid

    def _read(self) -> tuple[dict[str, dict], dict[str, dict[int, list[dict]]]]:
        lines = self.path.read_text().splitlines()
        head = json.loads(lines[0]) if lines else {}
        if not self._same_grid(head.get("config")):
            raise ConfigError(f"--resume: {self.path} was written by a different evaluation grid; use another --out")
        finished, asked = {}, {}
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption: that context or question runs again
                continue
            if "question" in entry:
                asked.setdefault(entry["context"], {})[entry["question"]] = entry["runs"]
            else:
                finished[entry["context"]] = entry
        return finished, {c: qs for c, qs in asked.items() if c not in finished}


def _question_line(context: str, question: int, runs: list[dict]) -> dict:
    """One answered question of an unfinished context, as the log holds it."""
    return {"context": context, "question": question, "runs": runs}
