"""Properties of the prefix cache's page keys (:func:`icekv.kv.prefix_cache.page_keys`): a key
names its page's tokens and every token before them, so a prompt is served the cached pages of
exactly its own prefix. Equal prefixes give equal keys; a token changed changes the key of its
page and of every later one and of no earlier one (an earlier key that changed would lose a hit, a
later one that did not would serve another prompt's KV); a partial last page has no key; another
model (or KV format, which the model id names) shares no key."""

from hypothesis import given, settings
from hypothesis import strategies as st

from icekv.kv.prefix_cache import page_keys

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=200)
TOKENS = st.integers(0, 2**31 - 1)
# few distinct tokens, so that pages repeat within a prompt and prompts share prefixes
IDS = st.lists(st.one_of(st.integers(0, 3), TOKENS), max_size=80)
PAGE_SIZES = st.integers(1, 16)
MODELS = st.text(max_size=12)


@SETTINGS
@given(ids=IDS, page_size=PAGE_SIZES, model_id=MODELS, tail=IDS, other_tail=IDS)
def test_equal_prefixes_give_equal_keys(ids, page_size, model_id, tail, other_tail):
    keys = page_keys(model_id, ids, page_size)
    assert len(keys) == len(ids) // page_size  # a partial last page has none
    assert page_keys(model_id, ids, page_size) == keys
    shared = len(ids) // page_size
    assert page_keys(model_id, ids + tail, page_size)[:shared] == keys
    assert page_keys(model_id, ids + other_tail, page_size)[:shared] == keys
    for n in range(len(ids) + 1):
        assert page_keys(model_id, ids[:n], page_size) == keys[: n // page_size]


@SETTINGS
@given(ids=IDS.filter(bool), page_size=PAGE_SIZES, model_id=MODELS, at=st.integers(0, 10_000), token=TOKENS)
def test_a_changed_token_changes_its_page_and_every_later_key_only(ids, page_size, model_id, at, token):
    at %= len(ids)
    changed = list(ids)
    changed[at] = token if token != ids[at] else token + 1
    before, after = page_keys(model_id, ids, page_size), page_keys(model_id, changed, page_size)
    page = at // page_size
    assert after[:page] == before[:page]
    assert all(a != b for a, b in zip(after[page:], before[page:]))
    assert not set(after[page:]) & set(before)  # nor equal to any key of the original prompt


@SETTINGS
@given(pages=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4), min_size=1, max_size=12),
       model_id=MODELS)
def test_keys_within_a_prompt_are_distinct_even_where_pages_repeat(pages, model_id):
    """A page's key names its position in the chain: the same tokens twice are two pages."""
    keys = page_keys(model_id, [t for page in pages for t in page], 4)
    assert len(set(keys)) == len(keys) == len(pages)


@SETTINGS
@given(ids=IDS, page_size=PAGE_SIZES, model_id=MODELS, other=MODELS)
def test_another_model_shares_no_key(ids, page_size, model_id, other):
    if other == model_id:
        other += "x"
    assert not set(page_keys(model_id, ids, page_size)) & set(page_keys(other, ids, page_size))
