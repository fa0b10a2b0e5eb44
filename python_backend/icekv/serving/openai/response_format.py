"""OpenAI's ``response_format``: plain text, JSON mode or a JSON schema, and the schema text the
engine's grammar holds an answer to."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from icekv.serving.openai.messages import Strict


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: the schema the output must satisfy (``strict`` is accepted:
    the output is always held to the whole schema)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's ``response_format``: plain text, JSON mode (any JSON object) or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is required with type json_schema, and only then")
        return self

    def schema_text(self) -> str | None:
        """The schema the output is held to, as JSON text; None: free text."""
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        return None if self.json_schema is None else json.dumps(self.json_schema.schema_)
