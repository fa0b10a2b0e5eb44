"""A chat as OpenAI's API sends it: messages (text parts, an assistant's earlier tool calls, tool
results) and the function tools a request offers, validated strictly (no coercion, unknown fields
refused)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from icekv.json_text import JSONTextError, read_json


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _a_json_object(cls, arguments: str) -> str:
        try:
            value = read_json(arguments)
        except JSONTextError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return arguments


class MessageToolCall(Strict):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and only a tool message has one")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (an assistant message with tool_calls may leave it null)")
        return self

    def for_template(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else [
            p.model_dump() for p in self.content]
        message = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted: a forced call's arguments are always held to the schema


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction
