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
    def _parsed(cls, value: str | dict[str, Any]) -> dict[str, Any] | str:
        """The chat template gets the arguments as an object (as Hugging Face templates expect).
        Text that is not a JSON object (a call cut short, as this server returns it) stays the
        text, so a client can send back any call it got."""
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
        return parsed if isinstance(parsed, dict) else value


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
    reasoning_content: str | None = Field(
        None, description="This server's own reasoning_content, sent back: to the template."
    )
    reasoning: str | None = Field(None, description="The same under vLLM's newer name.")
    refusal: None = Field(None, description="Only null (a returned message sent back).")

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
