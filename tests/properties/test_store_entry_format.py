"""Properties of the context store's entry format (:mod:`icekv.store.format`) and the prefix
pages' (:mod:`icekv.store.prefix_pages`): any context or page written reads back exactly, bit for
bit; and any bytes a store hands back, random, damaged, or rewritten and signed again (a store
without a key is signed with a plain sha256 anyone can compute), are either refused with the
store's own StoreError (what the readers catch: an entry refused is prefilled again) or read back
as exactly what they hold, never another exception."""

import json
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from icekv.compress.compressed import CompressedContext, CompressedLayer
from icekv.config.paging import KV_DTYPES
from icekv.store.format import FIELDS, StoreError, decode, digest, encode
from icekv.store.prefix_pages import decode_page, encode_page

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=150)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SECRETS = st.none() | st.binary(min_size=1, max_size=16)
KEYS = st.text(max_size=16)


def _bits(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of random bits (NaNs and infinities included) of ``shape`` and ``dtype``."""
    size = dtype.itemsize
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype)


@st.composite
def _layer(draw, page_size: int, length: int, width: int, dtype: torch.dtype) -> CompressedLayer:
    """A layer as compression makes them: pages of kept tokens per KV head, in CSR order."""
    per_head = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    pages = sum(per_head)
    seed = draw(st.integers(0, 2**32))
    lens = draw(st.lists(st.integers(0, page_size), min_size=pages, max_size=pages))
    positions = draw(st.lists(st.integers(-1, length - 1), min_size=pages * page_size, max_size=pages * page_size))
    shape = (pages, page_size, width)
    return CompressedLayer(_bits(shape, dtype, seed), _bits(shape, dtype, seed + 1),
                           torch.tensor(lens, dtype=torch.int32),
                           torch.tensor(positions, dtype=torch.int32).reshape(pages, page_size),
                           torch.tensor([0, *torch.tensor(per_head).cumsum(0).tolist()], dtype=torch.int64))


@st.composite
def _context(draw) -> CompressedContext:
    # a context is shorter than 2**31 tokens: its positions are int32
    page_size, length, width = draw(st.integers(1, 4)), draw(st.integers(1, 2**31 - 1)), draw(st.integers(1, 4))
    kv_dtype = draw(st.sampled_from(KV_DTYPES))
    dtype = torch.int8 if kv_dtype != "auto" else draw(st.sampled_from(FLOATS))
    layers = draw(st.lists(_layer(page_size, length, width, dtype), min_size=1, max_size=3))  # a context has layers
    return CompressedContext(length, page_size, layers, draw(st.text(max_size=8)),
                             draw(st.floats(0, 1, exclude_min=True)), draw(st.integers(0, 2**62)), kv_dtype)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included), of one dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _same(a: CompressedContext, b: CompressedContext) -> bool:
    budget = a.kv_budget == b.kv_budget or (math.isnan(a.kv_budget) and math.isnan(b.kv_budget))
    return ((a.length, a.page_size, a.method, a.full_bytes, a.kv_dtype, len(a.layers))
            == (b.length, b.page_size, b.method, b.full_bytes, b.kv_dtype, len(b.layers)) and budget
            and all(_same_tensor(getattr(x, f), getattr(y, f)) for x, y in zip(a.layers, b.layers) for f in FIELDS))


def _meta(blob: bytes) -> dict[str, str]:
    return json.loads(blob[8: 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]


def _read(blob: bytes, key: str, model_id: str, secret: bytes | None) -> CompressedContext | None:
    """The entry, or None when it is refused with StoreError (any other exception fails the test)."""
    try:
        return decode(blob, key, model_id, secret)
    except StoreError as e:
        assert str(e)
        return None


@SETTINGS
@given(ctx=_context(), key=KEYS, model_id=KEYS, secret=SECRETS)
def test_a_context_reads_back_exactly(ctx, key, model_id, secret):
    assert _same(decode(encode(ctx, key, model_id, secret), key, model_id, secret), ctx)


@SETTINGS
@given(blob=st.binary(max_size=300), header=st.binary(max_size=300), key=KEYS, secret=SECRETS)
def test_any_bytes_are_refused_with_a_store_error(blob, header, key, secret):
    """Random bytes, and random bytes behind a header length that points into them."""
    for data in (blob, len(header).to_bytes(8, "little") + header + blob):
        assert _read(data, key, "m", secret) is None


@SETTINGS
@given(ctx=_context(), secret=SECRETS, edits=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255),
                                                                st.sampled_from(["set", "insert", "delete", "cut"])),
                                                      min_size=1, max_size=3))
def test_a_damaged_entry_is_refused_or_reads_back_as_written(ctx, secret, edits):
    blob = bytearray(encode(ctx, "k", "m", secret))
    for at, byte, how in edits:
        at %= len(blob) + 1
        if how == "set" and at < len(blob):
            blob[at] = byte
        elif how == "insert":
            blob.insert(at, byte)
        elif how == "delete" and at < len(blob):
            del blob[at]
        elif how == "cut":
            del blob[at:]
    read = _read(bytes(blob), "k", "m", secret)
    assert read is None or _same(read, ctx)


ANY_TENSOR = st.builds(_bits, st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
                       st.sampled_from([torch.float32, torch.int32, torch.int64, torch.int8, torch.bfloat16]),
                       st.integers(0, 2**32)) | st.builds(lambda v: torch.tensor(v), st.integers(-5, 5))
META_TEXT = st.one_of(st.text(max_size=6), st.sampled_from(["", "-1", "0", "1", "2", "07", " 3 ", "1e3", "nan", "inf",
                                                            "auto", "int8", "9" * 5000]))


@SETTINGS
@given(ctx=_context(), secret=SECRETS,
       meta_edits=st.dictionaries(st.sampled_from(["length", "page_size", "layers", "method", "kv_budget", "full_bytes",
                                                   "kv_dtype", "extra"]), st.none() | META_TEXT, max_size=3),
       tensor_edits=st.dictionaries(st.sampled_from([f"{i}.{f}" for i in range(3) for f in FIELDS] + ["x"]),
                                    st.none() | ANY_TENSOR, max_size=3))
def test_an_entry_rewritten_and_signed_again_is_refused_or_read_as_it_says(ctx, secret, meta_edits, tensor_edits):
    """Whoever can write a store (and, when it has a key, holds it) can make an entry with a valid
    digest that icekv never wrote: a field missing or not a number, a tensor missing, extra or of
    another shape. It is refused, or every field and tensor in it is what the reader gets."""
    blob = encode(ctx, "k", "m", secret)
    meta = _meta(blob)
    tensors = load(blob)
    for edited, edits in ((meta, meta_edits), (tensors, tensor_edits)):
        for name, value in edits.items():  # None: removed
            if value is None:
                edited.pop(name, None)
            else:
                edited[name] = value
    meta["digest"] = digest(meta, tensors, secret)
    read = _read(save(tensors, metadata=meta), "k", "m", secret)
    if read is None:
        return
    assert (read.length, read.page_size, read.method, read.full_bytes, len(read.layers)) == (
        int(meta["length"]), int(meta["page_size"]), meta["method"], int(meta["full_bytes"]), int(meta["layers"]))
    budget = float(meta["kv_budget"])
    assert read.kv_budget == budget or (math.isnan(budget) and math.isnan(read.kv_budget))
    held = {f"{i}.{f}": getattr(layer, f) for i, layer in enumerate(read.layers) for f in FIELDS}
    assert held.keys() == tensors.keys()  # no tensor of the entry left unread
    assert all(_same_tensor(held[name], tensors[name]) for name in held)


PAGE_SHAPE = (2, 2, 1, 4, 3)  # [L, 2, Hkv, P, W]


PAGE_DTYPES = st.sampled_from([*FLOATS, torch.int8])


def _page(blob: bytes, dtype: torch.dtype, secret: bytes | None) -> torch.Tensor | None:
    """The page's rows, or None when they are refused with StoreError."""
    try:
        return decode_page(blob, "k", "m", PAGE_SHAPE, dtype, secret)
    except StoreError as e:
        assert str(e)
        return None


@SETTINGS
@given(seed=st.integers(0, 2**32), dtype=PAGE_DTYPES, key=KEYS, model_id=KEYS, secret=SECRETS)
def test_a_prefix_page_reads_back_exactly(seed, dtype, key, model_id, secret):
    page = _bits(PAGE_SHAPE, dtype, seed)
    assert _same_tensor(decode_page(encode_page(page, key, model_id, secret), key, model_id, PAGE_SHAPE, dtype, secret),
                        page)


@SETTINGS
@given(seed=st.integers(0, 2**32), dtype=PAGE_DTYPES, secret=SECRETS,
       edits=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=3))
def test_a_damaged_prefix_page_is_refused_or_reads_back_as_written(seed, dtype, secret, edits):
    page = _bits(PAGE_SHAPE, dtype, seed)
    blob = bytearray(encode_page(page, "k", "m", secret))
    for at, byte in edits:
        blob[at % len(blob)] = byte
    read = _page(bytes(blob), dtype, secret)
    assert read is None or _same_tensor(read, page)


@SETTINGS
@given(dtype=PAGE_DTYPES, secret=SECRETS,
       tensors=st.dictionaries(st.sampled_from(["rows", "x"]), ANY_TENSOR | st.builds(
           _bits, st.just(PAGE_SHAPE), PAGE_DTYPES, st.integers(0, 2**32)), max_size=2))
def test_a_prefix_page_rewritten_and_signed_again_is_refused_or_its_rows_read_exactly(dtype, secret, tensors):
    meta = _meta(encode_page(_bits(PAGE_SHAPE, dtype, 0), "k", "m", secret))
    meta["digest"] = digest(meta, tensors, secret)
    read = _page(save(tensors, metadata=meta), dtype, secret)
    assert read is None or _same_tensor(read, tensors["rows"])


def test_a_prefix_page_signed_without_rows_is_refused():
    """Regression: a digest-right page entry with no ``rows`` tensor raised KeyError."""
    meta = _meta(encode_page(torch.zeros(PAGE_SHAPE), "k", "m"))
    meta["digest"] = digest(meta, {}, None)
    assert _page(save({}, metadata=meta), torch.float32, None) is None
