"""Typed bodies of OpenAI's Responses API (``POST /v1/responses``), stateless.

Unknown fields are rejected; fields Tandem does not implement are accepted only at their
neutral value (as for chat completions). Input items are a union on ``type`` (a message may
omit it, as the official clients' short form does)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tandem.server.openai_schema import MAX_MESSAGES
from tandem.server.tool_calls import MAX_TOOLS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Strict):
    """Parsed so that the refusal can name it: no vision models here."""

    type: Literal["input_image", "input_file", "input_audio"]
    model_config = ConfigDict(extra="allow")


Part = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(
        None, description="Only the neutral value: output length is the model's own."
    )


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="none / minimal turn thinking off in the chat template, others on."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None,
        description="Accepted; no summary is generated: the whole reasoning is in the "
        "reasoning item's content.",
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "required", "none"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: Literal[False] | None = Field(
        None, description="Stateless: responses are never stored (true is refused)."
    )
    previous_response_id: None = Field(
        None, description="Stateless: send the whole history in input instead."
    )
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(
        None, description="Accepted: the prefix cache finds shared prefixes by itself."
    )
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    background: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    max_tool_calls: None = None

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("store") is True:
                raise ValueError(
                    "store: this server is stateless and keeps no responses; send store: false"
                )
            if data.get("previous_response_id") is not None:
                raise ValueError(
                    "previous_response_id: this server is stateless; send the whole "
                    "conversation in input"
                )
        return data

    @model_validator(mode="after")
    def _function_tools(self) -> ResponsesRequest:
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}]: {kind!r} tools are not supported (only function)")
            FunctionTool.model_validate(tool)
        return self


class FunctionToolList(BaseModel):
    tools: list[FunctionTool]
