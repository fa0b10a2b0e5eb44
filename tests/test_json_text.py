"""icekv.json_text.read_json: JSON from outside, refused by one rule with a message that names why."""

import pytest

from icekv.json_text import JSONTextError, read_json


@pytest.mark.parametrize("text,why", [
    ("{", "Expecting property name"),
    ('{"a": ' + "9" * 5000 + "}", "too many digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    ('{"a": "\\ud800"}', "lone surrogate"),
    (b"\xff\xfe\xfd", "not UTF-8"),
])
def test_what_python_cannot_read_is_one_refusal_naming_why(text, why):
    with pytest.raises(JSONTextError, match=why):
        read_json(text)


def test_json_it_can_use_reads_as_json_loads_does():
    assert read_json('{"a": [1, 2.5, "h\\u00e9 \\ud83d\\ude00", null, true]}') == {"a": [1, 2.5, "hé 😀", None, True]}
    assert read_json(b'{"n": 123456789012345678901234567890}') == {"n": 123456789012345678901234567890}
