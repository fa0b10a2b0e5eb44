"""Decoding drops special tokens, but keeps those a reader of the output needs: a Hermes 3 style
tokenizer makes ``<tool_call>`` special, and its calls must still reach the text."""

import shutil

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from icekv.model import Tokenizer
from icekv.serving.tool_formats import FORMATS, HERMES, split_calls


@pytest.fixture(scope="module")
def hermes3_style(tmp_path_factory, smollm2_dir):
    """The default model's tokenizer with the Hermes tags added as special tokens."""
    path = tmp_path_factory.mktemp("hermes3")
    hf = HFTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    hf.save(str(path / "tokenizer.json"))
    shutil.copy(smollm2_dir / "tokenizer_config.json", path / "tokenizer_config.json")
    return Tokenizer(path)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def test_special_tags_are_dropped_unless_the_format_keeps_them(hermes3_style):
    tokenizer = hermes3_style
    ids = tokenizer.encode("Let me check.<|im_end|>" + CALL)
    assert tokenizer.token_id("<tool_call>") in ids  # one special token, as in Hermes 3
    assert "<tool_call>" not in tokenizer.decode(ids)
    tokenizer.keep_in_text(HERMES.markup)
    text = tokenizer.decode(ids)
    assert "<|im_end|>" not in text  # other special tokens are still dropped
    content, calls = split_calls(text, ["get_weather"], HERMES)
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == \
        [("get_weather", '{"city": "Paris", "days": [1, 2]}')]


def test_formats_whose_markers_read_without_them_keep_nothing():
    assert [f.markup for name, f in sorted(FORMATS.items()) if name != "hermes"] == [(), ()]
