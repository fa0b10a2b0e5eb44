"""Coverage-guided fuzzing (atheris: libFuzzer for Python) of what icekv reads from outside:

- ``store_entry``: a context store entry's bytes (:func:`icekv.store.format.decode`), raw, and
  rebuilt from a real entry with a field or tensor changed and the sha256 digest made right again
  (what anyone who can write an unkeyed store can plant). Contract: a :class:`StoreError`, or a
  context whose layers hold together.
- ``tool_calls``: model output parsed for tool calls (:mod:`icekv.serving.tool_calls`), whole and
  streamed in arbitrary pieces. Contract: no exception, and the same content and calls both ways.
- ``json_schema``: a request's JSON schema compiled for constrained decoding
  (:class:`icekv.engine.grammar.Grammars`), as raw bytes or as a schema built from them (nested
  keywords, bounds, patterns, formats, references). Contract: a ConfigError naming the problem, or
  a grammar whose first mask allows some token.

Each target runs in child processes until ``--seconds`` or ``--runs`` executions, whichever comes
first; its corpus lives outside git (in the cache directory), seeded with real inputs generated
here; a crash's input is saved under ``--out``, to become a regression test
(``tests/bench/test_fuzz_targets.py`` replays the seeds and every saved input through the same
targets, uninstrumented).

    .venv/bin/python bench/fuzz_targets.py [--targets store_entry,tool_calls,json_schema] \
        [--seconds 600] [--runs N] [--out bench/results/fuzz_targets]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

KEY = "0" * 64
MODEL_ID = "fuzz-model"
TOOL_NAMES = ("get_weather", "lookup")
CHILD_RUNS = 25_000  # executions per fuzzing process: an instrumented one grows by tens of KB an execution


def _real_context():
    """A small compressed context of the real format: 2 layers, 2 KV heads, pages of 4."""
    import torch

    from icekv.compress.compressed import CompressedContext, CompressedLayer

    layers = []
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        layers.append(CompressedLayer(k=torch.randn(3, 4, 8, generator=g), v=torch.randn(3, 4, 8, generator=g),
                                      page_len=torch.tensor([4, 2, 3], dtype=torch.int32),
                                      positions=torch.tensor([[0, 1, 2, 3], [5, 7, -1, -1], [1, 4, 6, -1]],
                                                             dtype=torch.int32),
                                      head_indptr=torch.tensor([0, 2, 3], dtype=torch.int64)))
    return CompressedContext(8, 4, layers, "kv2", 0.5, 4096)


class StoreEntry:
    """The ``store_entry`` target; its first byte picks raw bytes (even) or a rebuilt entry (odd)."""

    def __init__(self):
        from icekv.store.format import encode

        self.entry = encode(_real_context(), KEY, MODEL_ID)

    def seeds(self) -> list[bytes]:
        return [b"\x00" + self.entry, b"\x01\x00layers\x003", b"\x01\x01k\x00\x02"]

    def __call__(self, data: bytes) -> None:
        from icekv.store.format import StoreError, decode

        if not data:
            return
        blob = data[1:] if data[0] % 2 == 0 else self._rebuilt(data[1:])
        try:
            ctx = decode(blob, KEY, MODEL_ID)
        except StoreError:
            return
        for layer in ctx.layers:  # a context the engine would attend: its layers hold together
            layer.padded()

    def _rebuilt(self, data: bytes) -> bytes:
        """The real entry with one metadata value (data: 0, name, 0, value) or one tensor (data: 1,
        name, 0, shape bytes) replaced, its sha256 digest recomputed."""
        import torch
        from safetensors.torch import load, save

        from icekv.store.format import digest

        n_header = int.from_bytes(self.entry[:8], "little")
        meta = json.loads(self.entry[8: 8 + n_header])["__metadata__"]
        tensors = load(self.entry)
        kind, rest = data[:1], data[1:]
        name, _, value = rest.partition(b"\x00")
        name = name.decode("utf-8", "replace")
        if kind == b"\x01":
            shape = [b % 5 for b in value[:3]]
            dtype = (torch.float32, torch.int32, torch.int64, torch.uint8)[len(value) % 4]
            tensors[name if name in tensors else "0.head_indptr"] = torch.zeros(shape, dtype=dtype)
        else:
            meta[name if name in meta else "layers"] = value.decode("utf-8", "replace")
        meta.pop("digest", None)
        meta["digest"] = digest(meta, tensors, None)
        return save(tensors, metadata=meta)


class ToolCalls:
    """The ``tool_calls`` target: its first bytes cut the rest (the output text) into pieces."""

    def seeds(self) -> list[bytes]:
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        return [b"\x03\x07\x0b" + s.encode() for s in (
            call, f"Let me check.\n{call}\n{call}", '{"name": "lookup", "arguments": {"q": "x"}}', "plain text",
            "<tool_call>{broken</tool_call> and <tool_", "<tool_call>\n{}\n</tool_call>")]

    def __call__(self, data: bytes) -> None:
        from icekv.serving.tool_calls import ToolCall, ToolCallStream

        cuts, text = sorted(set(data[:3])), data[3:].decode("utf-8", "replace")
        names = TOOL_NAMES if len(data) % 2 else ()

        def parsed(pieces: list[str]) -> tuple[str, list[ToolCall]]:
            stream = ToolCallStream(names)
            parts = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
            return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]

        bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        whole, streamed = parsed([text]), parsed(pieces)
        assert whole == streamed, (text, pieces, whole, streamed)
        for call in whole[1]:
            assert isinstance(json.loads(call.arguments), dict)


class JsonSchema:
    """The ``json_schema`` target, over SmolLM2's tokenizer. Its first byte picks raw bytes as the
    schema (even) or a schema built from the rest (odd): the grammar library is native code that
    atheris sees no coverage in, so byte mutations alone rarely grow past a few keywords."""

    def __init__(self):
        import torch

        from icekv.assets import Assets
        from icekv.engine.grammar import Grammars

        tokenizer = (Assets().model_dir("smollm2-135m") / "tokenizer.json").read_text()
        self.grammars, self.logits = Grammars(tokenizer, [0, 2]), torch.zeros(49152)

    def seeds(self) -> list[bytes]:
        schemas = [{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                   {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
                   {"enum": ["a", "b"]}, {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   {"$ref": "#/$defs/x", "$defs": {"x": {"type": "boolean"}}}]
        return [b"\x00" + json.dumps(s).encode() for s in schemas] + [bytes([1, i]) * 24 for i in range(0, 250, 25)]

    def __call__(self, data: bytes) -> None:
        from icekv.config.request import SamplingConfig
        from icekv.errors import ConfigError

        if not data:
            return
        schema = data[1:].decode("utf-8", "replace") if data[0] % 2 == 0 else json.dumps(built_schema(data[1:]))
        try:
            sampling = SamplingConfig(max_tokens=4, json_schema=schema)
            grammar = self.grammars.for_request(sampling)
        except ConfigError:
            return
        assert bool((grammar.mask(self.logits) > float("-inf")).any()), "a compiled schema allows no first token"


SCALARS = ("string", "integer", "number", "boolean", "null")
STRING_FORMATS = ("date", "time", "date-time", "email", "uuid", "uri", "ipv4", "hostname", "duration", "bogus")


def built_schema(data: bytes) -> dict:
    """A JSON schema drawn from ``data``: nested objects, arrays, enums, consts, combinators,
    references, bounds, patterns and formats, any of them contradictory."""
    import atheris

    draw = atheris.FuzzedDataProvider(data)

    def value():
        kind = draw.ConsumeIntInRange(0, 4)
        return (draw.ConsumeUnicodeNoSurrogates(4) if kind == 0 else draw.ConsumeIntInRange(-9, 9) if kind == 1
                else draw.ConsumeBool() if kind == 2 else None if kind == 3 else draw.ConsumeRegularFloat())

    def node(depth: int) -> dict:
        kind = draw.ConsumeIntInRange(0, 11) if depth < 4 else draw.ConsumeIntInRange(0, 2)
        if kind == 0:
            return {"type": draw.PickValueInList(list(SCALARS))}
        if kind == 1:
            out = {"type": "string", "minLength": draw.ConsumeIntInRange(0, 6)}
            out |= {"maxLength": draw.ConsumeIntInRange(0, 6)} if draw.ConsumeBool() else {}
            out |= {"pattern": draw.ConsumeUnicodeNoSurrogates(8)} if draw.ConsumeBool() else {}
            out |= {"format": draw.PickValueInList(list(STRING_FORMATS))} if draw.ConsumeBool() else {}
            return out
        if kind == 2:
            bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
            return {"type": draw.PickValueInList(["integer", "number"]),
                    **{b: draw.ConsumeIntInRange(-50, 50) for b in bounds if draw.ConsumeBool()}}
        if kind == 3:
            names = [draw.ConsumeUnicodeNoSurrogates(5) for _ in range(draw.ConsumeIntInRange(0, 4))]
            out = {"type": "object", "properties": {n: node(depth + 1) for n in names}}
            out |= {"required": [n for n in names if draw.ConsumeBool()]}
            out |= {"additionalProperties": draw.ConsumeBool()} if draw.ConsumeBool() else {}
            return out
        if kind == 4:
            out = {"type": "array", "items": node(depth + 1), "minItems": draw.ConsumeIntInRange(0, 4)}
            out |= {"maxItems": draw.ConsumeIntInRange(0, 4)} if draw.ConsumeBool() else {}
            out |= {"prefixItems": [node(depth + 1)]} if draw.ConsumeBool() else {}
            return out
        if kind == 5:
            return {"enum": [value() for _ in range(draw.ConsumeIntInRange(0, 4))]}
        if kind == 6:
            return {"const": value()}
        if kind in (7, 8, 9):
            return {("anyOf", "oneOf", "allOf")[kind - 7]: [node(depth + 1)
                                                            for _ in range(draw.ConsumeIntInRange(0, 3))]}
        if kind == 10:
            return {"$ref": "#/$defs/d", "$defs": {"d": node(depth + 1)}}
        return {"not": node(depth + 1)}

    return node(0)


TARGETS = {"store_entry": StoreEntry, "tool_calls": ToolCalls, "json_schema": JsonSchema}


def child(target: str, corpus: str, libfuzzer_args: list[str]) -> None:
    """Fuzz ``target`` under atheris (libFuzzer's arguments pass through)."""
    import atheris

    with atheris.instrument_imports(include=["icekv", "fuzz_targets"]):
        import fuzz_targets  # this file again, instrumented: the schemas it builds count as coverage
        import icekv.config.request  # noqa: F401
        import icekv.engine.grammar  # noqa: F401
        import icekv.serving.tool_calls  # noqa: F401
        import icekv.store.format  # noqa: F401
    one = fuzz_targets.TARGETS[target]()
    atheris.Setup([sys.argv[0], *libfuzzer_args, corpus], one)
    atheris.Fuzz()


def fuzz(name: str, corpus: Path, seconds: int, runs: int, crashes: Path) -> dict:
    """Fuzz one target for ``seconds`` or ``runs`` executions, in child processes of at most
    ``CHILD_RUNS`` executions each over the one corpus (an instrumented process's memory grows with
    its executions); stops at the first crash."""
    t0, executions, child_runs, run = time.monotonic(), 0, 0, None
    while True:
        left_s = seconds - (time.monotonic() - t0)
        todo = CHILD_RUNS if runs < 0 else min(CHILD_RUNS, runs - executions)
        if left_s < 1 or todo <= 0:
            break
        run = subprocess.run([sys.executable, __file__, "--child", name, f"-max_total_time={int(left_s)}",
                              f"-runs={todo}", "-print_final_stats=1", f"-artifact_prefix={crashes}/{name}-",
                              "-rss_limit_mb=4096", str(corpus)], capture_output=True, text=True)
        executions += int(dict(re.findall(r"stat::(\w+):\s+(\d+)", run.stderr)).get("number_of_executed_units", 0))
        child_runs += 1
        if run.returncode:
            break
    failed = run is not None and run.returncode != 0
    return {"seconds": round(time.monotonic() - t0), "executions": executions, "processes": child_runs,
            "exit_code": run.returncode if run else None, "crashed": failed,
            "corpus_files": len(os.listdir(corpus)), "tail": run.stderr[-3000:] if failed else ""}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seconds", type=int, default=600, help="per target")
    ap.add_argument("--runs", type=int, default=-1, help="executions per target (-1: no limit)")
    ap.add_argument("--out", default="bench/results/fuzz_targets")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.child:
        return child(args.child, rest[-1], rest[:-1])
    from icekv.assets import Assets

    out = Path(args.out)
    (out / "crashes").mkdir(parents=True, exist_ok=True)
    saved = out / "results.json"
    results = json.loads(saved.read_text())["targets"] if saved.exists() else {}  # other targets' last runs
    for name in args.targets.split(","):
        corpus = Assets().cache_dir / "fuzz-corpus" / name
        corpus.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(TARGETS[name]().seeds()):
            (corpus / f"seed-{i}").write_bytes(seed)
        command = " ".join([Path(sys.executable).name, *sys.argv])
        results[name] = {"command": command, **fuzz(name, corpus, args.seconds, args.runs, out / "crashes")}
        print(name, {k: v for k, v in results[name].items() if k != "tail"}, flush=True)
        saved.write_text(json.dumps({"targets": results}, indent=1) + "\n")  # as each target ends


if __name__ == "__main__":
    main()
