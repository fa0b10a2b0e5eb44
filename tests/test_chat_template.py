"""The chat template renders exactly as transformers' apply_chat_template, and refuses what it should."""

import json

import pytest

from icekv.model import Tokenizer
from icekv.chat_template import ChatTemplate, ChatTemplateError, require_template

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"},
     {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of Spain? ünïcødé 😀"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_embedded_model_matches_transformers(smollm2_dir, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    ours = ChatTemplate.load(smollm2_dir)
    text = ours.render(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=True)["input_ids"]
    assert Tokenizer(smollm2_dir).encode(text) == list(ids)


def _folder(path, config: dict, jinja: str | None = None):
    path.mkdir()
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def test_template_sources_and_special_tokens(tmp_path):
    plain = ChatTemplate.load(_folder(tmp_path / "a", {}, "{{ bos_token }}{{ messages[0].content }}"))
    assert plain.render([{"role": "user", "content": "x"}]) == "x"  # no bos_token in the config: empty
    named = ChatTemplate.load(_folder(tmp_path / "b", {
        "bos_token": {"content": "<s>"},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert named.render([{"role": "user", "content": "x"}]) == "<s>D"
    assert ChatTemplate.load(_folder(tmp_path / "c", {"eos_token": "</s>"})) is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        require_template(None, tmp_path / "c")


def test_template_extensions_and_refusals():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}",
        {})
    assert template.render([{"role": "user", "content": "é"}, {"role": "user", "content": "y"}]) == \
        '{"role": "user", "content": "é"}'
    with pytest.raises(ChatTemplateError, match="refused the messages: no tools"):
        template.render([{"role": "tool", "content": "x"}])


def test_the_sandbox_keeps_templates_away_from_python_internals():
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}", {})
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        mutate.render([{"role": "user", "content": "x"}])
