"""bench/fuzz_targets.py's targets, uninstrumented, over their seeds and over inputs that broke
icekv before (each now answered within the target's contract): the fuzz targets themselves are
checked, and what they found stays found."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("fuzz_targets", BENCH / "fuzz_targets.py")
fuzz_targets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz_targets)

FOUND = {  # target -> inputs that once raised outside the contract
    "store_entry": [b"\x01\x00layers\x003",  # a digest-right entry naming a layer it lacks: KeyError
                    b"\x01\x01\x02"],  # a digest-right entry with a scalar tensor: RuntimeError in the digest
    "json_schema": [b'\x00{"maximum": 18446744211039428608}'],  # past 64 bits: ValueError (api_fuzz found it)
}


@pytest.mark.parametrize("name", ["store_entry", "tool_calls"])
def test_the_seeds_and_what_was_found_are_within_the_contract(name):
    target = fuzz_targets.TARGETS[name]()
    for data in target.seeds() + FOUND.get(name, []):
        target(data)


def test_the_store_entry_target_rebuilds_a_changed_entry_with_a_right_digest():
    from icekv.store.format import CorruptEntry, StoreError, decode

    target = fuzz_targets.StoreEntry()
    blob = target._rebuilt(b"\x00length\x00" + b"7")
    with pytest.raises(StoreError) as refused:
        decode(blob, fuzz_targets.KEY, fuzz_targets.MODEL_ID)
    assert not isinstance(refused.value, CorruptEntry) and "a position is outside" in str(refused.value)


@pytest.mark.model
def test_the_json_schema_target_over_its_seeds():
    target = fuzz_targets.JsonSchema()
    for data in target.seeds() + FOUND["json_schema"] + [b"\x00{", b"\x00[]", b'\x00{"type": 5}', b"\x01"]:
        target(data)


def test_built_schemas_reach_every_kind_of_node():
    """The structured half of the json_schema target: bytes become schemas whose nodes cover the
    keywords it draws from (any byte string gives a schema)."""
    import json
    import random

    rng, seen = random.Random(0), set()
    for _ in range(400):
        schema = fuzz_targets.built_schema(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120))))
        seen |= {key for key in _keys(json.loads(json.dumps(schema)))}
    assert {"type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "not", "pattern",
            "format", "minimum", "required"} <= seen


def _keys(node) -> set:
    if isinstance(node, dict):
        return set(node) | {k for value in node.values() for k in _keys(value)}
    if isinstance(node, list):
        return {k for value in node for k in _keys(value)}
    return set()
