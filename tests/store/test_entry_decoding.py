"""Store entries that bench/fuzz_targets.py's ``store_entry`` target found to break the decoder,
each refused now with a StoreError (never another exception): a digest proves the bytes are as
written, not that icekv wrote them, so an unkeyed store's entry (its sha256 anyone can compute)
must also hold together before it is used."""

import json

import pytest
import torch
from safetensors.torch import load, save

from icekv.store.format import StoreError, decode, digest, encode
from tests.store.test_store import _ctx

KEY, MODEL = "ab" * 32, "model-a"


def _planted(change) -> bytes:
    """A real entry with ``change(meta, tensors)`` applied and its sha256 digest made right again."""
    blob = encode(_ctx(), KEY, MODEL)
    meta = json.loads(blob[8: 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    tensors = load(blob)
    change(meta, tensors)
    meta.pop("digest")
    meta["digest"] = digest(meta, tensors, None)
    return save(tensors, metadata=meta)


def test_a_real_entry_still_decodes():
    assert len(decode(encode(_ctx(), KEY, MODEL), KEY, MODEL).layers) == 2


def test_an_entry_with_a_scalar_tensor_is_refused():
    blob = _planted(lambda meta, tensors: tensors.update({"0.head_indptr": torch.zeros(())}))
    with pytest.raises(StoreError, match="malformed: head_indptr"):
        decode(blob, KEY, MODEL)


def test_an_entry_whose_digest_is_not_ascii_is_refused():
    blob = encode(_ctx(), KEY, MODEL)
    meta = json.loads(blob[8: 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    with pytest.raises(StoreError, match="digest mismatch"):
        decode(save(load(blob), metadata={**meta, "digest": "é" * 64}), KEY, MODEL)


@pytest.mark.parametrize("change,problem", [
    (lambda m, t: m.update(layers="3"), "'2.k'"),
    (lambda m, t: m.update(layers="two"), "invalid literal"),
    (lambda m, t: m.update(page_size="8"), "pages of 8 slots"),
    (lambda m, t: m.update(length="10"), "a position is outside"),
    (lambda m, t: m.update(kv_dtype="int3"), "kv_dtype must be one of"),
    (lambda m, t: m.update(layers="-1"), "must be positive"),
    (lambda m, t: m.update(page_size="0"), "must be positive"),
    (lambda m, t: m.update(kv_budget="nan"), "kv_budget in (0, 1]"),
    (lambda m, t: t.update({"1.head_indptr": torch.tensor([0, 2, 5])}), "head_indptr must rise from 0 to the 3"),
    (lambda m, t: t.update({"1.head_indptr": torch.tensor([0, 2, 3], dtype=torch.int32)}), "must be int64"),
    (lambda m, t: t.update({"1.page_len": torch.tensor([16, 17, 9], dtype=torch.int32)}), "page length"),
    (lambda m, t: t.update({"0.v": torch.zeros(3, 16, 4)}), "must be alike"),
    (lambda m, t: t.update({"2.k": torch.zeros(1)}), "11 tensors for 2 layers"),
])
def test_a_digest_right_entry_that_does_not_hold_together_is_refused(change, problem):
    with pytest.raises(StoreError, match="malformed") as refused:
        decode(_planted(change), KEY, MODEL)
    assert problem in str(refused.value)
