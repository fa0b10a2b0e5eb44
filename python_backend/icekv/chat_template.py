"""A model's chat template: OpenAI-style messages -> the prompt text the model was tuned on.

The template is the model folder's ``chat_template.jinja`` or the ``chat_template`` entry of its
``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is used),
rendered in a sandboxed Jinja environment with the same settings, filters and globals as
transformers' ``apply_chat_template``, so a template cannot reach Python objects it was not
given and the rendered text equals transformers' for the same messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from icekv.errors import IcekvError
from icekv.json_text import JSONTextError, read_json

ROLES = ("system", "user", "assistant", "tool", "developer")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(IcekvError, ValueError):
    """The model has no chat template, the messages are malformed, or the template refused them."""


def _template_source(model_dir: Path, tokenizer_config: dict) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # named templates
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) and source.strip() else None


def _special_tokens(tokenizer_config: dict) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):  # serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(f"{where}.content[{i}] must be a text part "
                                        '({"type": "text", "text": ...}); this model reads text only')
            texts.append(part["text"])
        return "".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` in OpenAI's shape, their ``arguments`` (JSON text)
    parsed into the objects chat templates print."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise ChatTemplateError(f'{at} must be {{"type": "function", "function": {{"name", "arguments"}}}}')
        arguments = function.get("arguments", "{}")
        try:
            arguments = read_json(arguments) if isinstance(arguments, str) else arguments
        except JSONTextError:
            raise ChatTemplateError(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ChatTemplateError(f"{at}.function.arguments must be a JSON object")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten their content to text; raises ChatTemplateError.
    An assistant's ``tool_calls`` and a tool result's ``tool_call_id`` and ``name`` are kept."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ChatTemplateError(f"{where}: only an assistant message has tool_calls")
        content = message.get("content")
        normal = {"role": role, "content": "" if content is None and calls else message_text(content, where)}
        if calls:
            normal["tool_calls"] = _tool_calls(calls, where)
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                normal[key] = message[key]
        out.append(normal)
    return out


def normalize_tools(tools: Any) -> list[dict]:
    """Check OpenAI-style ``tools``: a list of ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` with distinct names; raises ChatTemplateError."""
    if not isinstance(tools, list):
        raise ChatTemplateError("tools must be a list of function tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise ChatTemplateError(f'tools[{i}] must be {{"type": "function", "function": {{"name", ...}}}}')
        if not isinstance(function.get("parameters", {}), dict):
            raise ChatTemplateError(f"tools[{i}].function.parameters must be a JSON schema object")
        if function["name"] in names:
            raise ChatTemplateError(f"tools[{i}]: the function name {function['name']!r} is given twice")
        names.add(function["name"])
    return tools


@dataclass(frozen=True)
class ChatTemplate:
    """One model's template; :meth:`render` turns messages into the prompt to tokenize."""

    source: str
    special_tokens: dict[str, str]

    @classmethod
    def load(cls, model_dir: str | Path) -> "ChatTemplate | None":
        """The folder's template, or None when the model has none."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = _template_source(model_dir, config)
        return None if source is None else cls(source, _special_tokens(config))

    @property
    def renders_tools(self) -> bool:
        """Does the template read ``tools`` (and so can show a model the functions it may call)?"""
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(_environment().parse(self.source))

    def render(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
               tools_optional: bool = False) -> str:
        """The prompt text for ``messages`` (validated first), ending with the assistant's header;
        ``tools``: the functions offered to the model, shown as the template shows them. A template
        that cannot show tools refuses them (ChatTemplateError), or, ``tools_optional`` (a turn that
        may not call them), renders without them. A developer message is a system message to a
        template that names no developer role."""
        from jinja2 import TemplateError

        messages = normalize_messages(messages)
        if "developer" not in self.source:  # OpenAI's newer name of the system role; unknown to the template,
            # which would drop the message (Qwen2.5's renders only the roles it knows)
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if tools and not self.renders_tools and not tools_optional:
            raise ChatTemplateError("this model's chat template does not render tools, so the model "
                                    "cannot be offered functions to call; send the request without tools")
        extra = {"tools": normalize_tools(tools)} if tools and self.renders_tools else {}
        try:
            template = _environment().from_string(self.source)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **extra, **self.special_tokens)
        except (TemplateError, RecursionError) as e:  # RecursionError: printing arguments nested too deep
            raise ChatTemplateError(f"the model's chat template failed: {e}") from None


def require_template(template: ChatTemplate | None, model_dir: str | Path) -> ChatTemplate:
    """``template``, or a clear error naming the model folder that has none."""
    if template is None:
        raise ChatTemplateError(f"the model in {Path(model_dir).name} has no chat template "
                                "(chat_template.jinja or tokenizer_config.json's chat_template); "
                                "send plain text instead of messages")
    return template
