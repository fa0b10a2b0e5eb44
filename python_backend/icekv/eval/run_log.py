"""A long evaluation's log: the grid it runs, then one JSON line per finished context.

A run of hours writes each context as it finishes, so it can be read while it runs and resumed
after an interruption without redoing a finished context. A resumed run must come from the same
grid (the fields that decide what a context holds); only the grid's extent may grow.
"""

from __future__ import annotations

import json
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
    """``path`` (None: no log) of a run over ``grid``; entries are keyed by their ``context``."""

    def __init__(self, path: Path | None, grid: dict):
        self.path, self.grid = path, grid

    def start(self, resume: bool) -> dict[str, dict]:
        """The finished entries kept (``resume``) or none; the log is rewritten to hold just them,
        so that a line an interruption cut is dropped, not appended to."""
        finished = self._read() if resume and self.path is not None and self.path.exists() else {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(e) + "\n" for e in [{"config": self.grid}, *finished.values()]))
        return finished

    def append(self, entry: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _read(self) -> dict[str, dict]:
        lines = self.path.read_text().splitlines()
        head = json.loads(lines[0]) if lines else {}
        if head.get("config") != self.grid:
            raise ConfigError(f"--resume: {self.path} was written by a different evaluation grid; use another --out")
        entries = {}
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption: that context runs again
                continue
            entries[entry["context"]] = entry
        return entries
