"""Typed pieces of a chat completions body: the messages (a union on ``role``) and the tools
the model may call (``tool_choice``). ``openai_schema.ChatCompletionRequest`` holds them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tandem.server.strict_schema import Strict, by_json_type, tagged

# ---- messages -------------------------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = by_json_type("a string or a list of text parts", String=str, Array=list[TextPart])


Arguments = by_json_type("a JSON object or its JSON text", String=str, Object=dict[str, Any])


class FunctionCall(Strict):
    name: str
    arguments: Arguments = Field(
        default_factory=dict, description="A JSON object, or its JSON text (default {})."
    )

    @field_validator("arguments")
    @classmethod
    def _parsed(cls, value: str | dict[str, Any]) -> dict[str, Any]:
        """The chat template gets the arguments as an object (as Hugging Face templates expect)."""
        if isinstance(value, dict):
            return value
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise ValueError("must be JSON text of an object") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return value


class ToolCall(Strict):
    """An earlier call of an assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Strict):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(Strict):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="Null or absent only with tool_calls.")
    name: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise ValueError("content: must be a string or text parts when there are no tool_calls")
        return self


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    name: str | None = None
    tool_call_id: str | None = Field(None, description="The call answered.")


ChatMessage = tagged(
    "role", SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage
)

# ---- tools ----------------------------------------------------------------------------------


class FunctionDefinition(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments.")
    strict: bool | None = Field(
        None, description="true: under tool_choice auto, the grammar enforces the arguments."
    )


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = by_json_type(
    'none, auto, required or {"type": "function", "function": {"name": ...}}',
    String=Literal["none", "auto", "required"],
    Object=NamedToolChoice,
)
