"""Typed bodies of OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``: the one
source of their validation and of their schemas in /openapi.json.

Types are strict (no "2" or 2.0 for an integer, booleans are booleans, numbers are finite),
unknown fields are rejected at every level, and the bounds are the ones the engine enforces.
Fields Tandem does not implement are accepted only at their neutral value. Unions are picked
by a discriminator (a message's ``role``, a format's ``type``, a value's JSON type), so an error
names one member's field (``messages[2].content[0].text``). What a schema cannot check — a
constraint's grammar, token ids against the vocabulary, the context length — is checked
right after validation (``requests``, ``guided``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from tandem.sampling_params import INT_MAX, MAX_GUIDED_SPEC, MAX_LOGPROBS
from tandem.server.guided import GUIDED_FIELDS
from tandem.server.openai_chat_schema import ChatMessage, ChatTool, NamedToolChoice, ToolChoice
from tandem.server.strict_schema import Strict, by_json_type, neutral, tagged, whole
from tandem.server.tool_calls import MAX_TOOLS

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 16
# chat_template_kwargs that would change the rendering the server decides: refused. (A
# client's own "chat_template" needs --trust-request-chat-template: chat_history.py.)
RESERVED_TEMPLATE_KWARGS = (
    "tokenize",
    "messages",
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "add_special_tokens",
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    bad = sorted(set(kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if bad:
        raise ValueError(f"{bad[0]!r} cannot be set through chat_template_kwargs")
    return kwargs


MAX_MESSAGES = 100_000  # Anthropic's own limit; the body size bounds the work anyway
# Integers travel to the engine as 64 bits. The bound is exclusive because /openapi.json
# writes bounds as floats, which hold 2^63 exactly but not 2^63 - 1.
INT_END = INT_MAX + 1


# ---- output constraints ---------------------------------------------------------------------

GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GUIDED_SPEC)]
Choices = Annotated[list[str], Field(min_length=1)]
JsonSchema = by_json_type(
    "a JSON schema (an object or a boolean)", Object=dict[str, Any], Boolean=bool
)
GuidedJson = by_json_type(
    "a JSON schema (an object or a boolean) or its JSON text",
    Object=dict[str, Any],
    Boolean=bool,
    String=str,
)


class ResponseFormatText(Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(Strict):
    name: str | None = None
    description: str | None = None
    schema_: JsonSchema = Field(
        default_factory=dict,
        alias="schema",
        description="The JSON Schema the output must match (default: any JSON).",
    )
    strict: bool | None = Field(None, description="Accepted; enforcement is always strict.")


class ResponseFormatJsonSchema(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class ResponseFormatRegex(Strict):
    type: Literal["regex"]
    regex: GrammarText


class ResponseFormatGrammar(Strict):
    type: Literal["grammar"]
    grammar: GrammarText = Field(description="Lark in llguidance's dialect, or GBNF.")


class ResponseFormatChoice(Strict):
    type: Literal["choice"]
    choice: Choices


ResponseFormat = tagged(
    "type",
    ResponseFormatText,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatRegex,
    ResponseFormatGrammar,
    ResponseFormatChoice,
)

# ---- the bodies -----------------------------------------------------------------------------

StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
TokenId = Annotated[int, Field(ge=0, lt=INT_END)]
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,19}$")], Annotated[float, Field(ge=-100, le=100)]],
    Field(json_schema_extra={"additionalProperties": False}),  # keys must match the pattern
    whole("must map token ids (decimal strings) to numbers in [-100, 100]"),
]


class StreamOptions(Strict):
    include_usage: bool | None = Field(None, description="A final chunk with usage.")
    continuous_usage_stats: bool | None = Field(
        None, description="Extension (as vLLM): usage so far on every chunk."
    )


INTEGERS = (
    "Integer fields take JSON integers written without a fraction (2, not 2.0); null in an "
    "optional field means the field is not given."
)


class GenerationBody(Strict):
    """What both endpoints take."""

    model_config = ConfigDict(json_schema_extra={"description": INTEGERS})

    model: str | None = Field(
        None, description="The served model name (GET /v1/models); any other name is a 404."
    )
    temperature: float | None = Field(None, ge=0, description="0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; 1 disables it.")
    top_k: int | None = Field(None, ge=-1, lt=INT_END, description="0 or -1 disables top-k.")
    seed: int | None = Field(
        None, ge=0, lt=INT_END, description="Same seed and inputs, same output. Sample j: seed + j."
    )
    stop: (
        Annotated[
            StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
            whole(
                f"must be a string or a list of at most {MAX_STOP_STRINGS} strings of at most "
                f"{MAX_STOP_LENGTH} characters"
            ),
        ]
        | None
    ) = Field(
        None,
        description="Strings matched on the generated text; the output ends before the first.",
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, description="Token ids that end the output (as EOS does)."
    )
    ignore_eos: bool | None = Field(None, description="Generate past EOS.")
    n: int | None = Field(None, ge=1, le=MAX_N, description="Samples per prompt.")
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Extension: log-probabilities of every prompt token after the first, with "
        "the top k alternatives, in each choice's prompt_logprobs.",
    )
    min_p: float | None = Field(None, ge=0, le=1, description="Relative to the most likely token.")
    min_tokens: int | None = Field(
        None,
        ge=0,
        lt=INT_END,
        description="EOS and stop_token_ids cannot end the output earlier; at most max_tokens, "
        "not with an output constraint.",
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, gt=0, le=10, description="As vLLM: over prompt and generated tokens; 1 disables it."
    )
    logit_bias: LogitBias | None = Field(
        None, description="Token id (below the vocabulary size) to a bias added to its logit."
    )
    user: str | None = Field(None, description="Accepted for compatibility; not used.")
    stream: bool | None = Field(
        None, description="Server-sent events (text/event-stream), ending with data: [DONE]."
    )
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(
        None, description="Extension (as vLLM): token_ids in each choice."
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="Constrained decoding: a JSON object, a JSON Schema, a regular expression, "
        "a grammar or one of the choices ({type: text}: free). At most one of response_format "
        "and the guided_* fields; an invalid grammar is a 400.",
    )
    guided_json: GuidedJson | None = Field(
        None,
        description="Extension (as vLLM): a json_schema constraint (a schema or its JSON text).",
    )
    guided_regex: GrammarText | None = Field(None, description="Extension (as vLLM).")
    guided_grammar: GrammarText | None = Field(None, description="Extension (as vLLM).")
    guided_choice: Choices | None = Field(None, description="Extension (as vLLM).")

    def constraints(self) -> list[str]:
        """The fields that constrain the output (``{type: text}`` does not)."""
        given = [k for k in GUIDED_FIELDS if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return given

    def check_common(self, max_tokens: int | None, forced: bool = False) -> None:
        """Cross-field rules of both endpoints (``max_tokens``: the one in effect; ``forced``:
        a tool choice whose grammar constrains the output)."""
        given = self.constraints()
        if len(given) > 1:
            raise ValueError(f"{given[1]}: at most one of {', '.join(given)} may be given")
        if self.min_tokens:
            if max_tokens is not None and self.min_tokens > max_tokens:
                raise ValueError(f"min_tokens: must not exceed max_tokens ({max_tokens})")
            if given or forced:
                raise ValueError(
                    "min_tokens: cannot be combined with an output constraint (the grammar "
                    "decides where the output may end)"
                )


Prompt = Annotated[
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    whole(
        "must be a non-empty string, list of strings, list of token ids or list of token-id lists"
    ),
]


class CompletionRequest(GenerationBody):
    prompt: Prompt = Field(
        description="A string, token ids (each below the vocabulary size), or a list of either: "
        "one choice (times n) per prompt. Empty text only with a suffix."
    )
    max_tokens: int | None = Field(
        None,
        ge=0,
        lt=INT_END,
        description="Tokens to generate (default 16). Prompt tokens + max_tokens must fit the "
        "context length (GET /v1/models max_model_len), else 400. 0 only with echo: the prompt "
        "and its logprobs, no output.",
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Log-probabilities of the sampled tokens, top k."
    )
    echo: bool | None = Field(None, description="The prompt (and its logprobs) before the output.")
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description="Sample best_of >= n per prompt, return the n most likely; not streamed.",
    )
    suffix: str | None = Field(
        None,
        description="Fill-in-the-middle: the text after the insertion point (each prompt is the "
        "text before it). Needs FIM tokens in the model's vocabulary and text prompts; not "
        "with echo. Empty or null: a plain completion.",
    )
    top_logprobs: neutral(Annotated[int, Field(ge=0, le=0)], "0 or null") | None = None
    tools: neutral(Annotated[list[Any], Field(max_length=0)], "[] or null") | None = None
    tool_choice: neutral(Literal["none"], "none or null") | None = None
    parallel_tool_calls: neutral(None, "null") = None

    @model_validator(mode="after")
    def _rules(self) -> CompletionRequest:
        prompts = self.prompts()
        if self.suffix:
            if any(isinstance(p, list) for p in prompts):
                raise ValueError("suffix: needs a text prompt, not token ids")
            if self.echo:
                raise ValueError("suffix: 'echo' cannot be combined with 'suffix'")
        elif "" in prompts:  # with a suffix, the cursor may be first
            raise ValueError("prompt: must not be empty")
        score_only = self.max_tokens == 0
        if score_only and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo: prompt scoring)")
        n = self.n or 1
        if self.best_of is not None:
            if self.best_of < n:
                raise ValueError(f"best_of: must be between n ({n}) and {MAX_N}")
            if self.stream and self.best_of > n:
                raise ValueError("best_of: cannot be streamed")
        if score_only and self.min_tokens:
            raise ValueError("min_tokens: must be 0 when max_tokens is 0")
        if score_only and self.best_of is not None and self.best_of > n:
            raise ValueError("best_of: needs max_tokens of at least 1")
        self.check_common(self.max_tokens or None)
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(
        min_length=1,
        max_length=MAX_MESSAGES,
        description="Rendered with the model's chat template.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        lt=INT_END,
        description="Tokens to generate (default: --default-max-tokens, at most the context "
        "left). Prompt tokens + max_tokens must fit the context length, else 400.",
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, lt=INT_END, description="Takes precedence over max_tokens."
    )
    logprobs: bool | None = Field(None, description="Log-probabilities of the sampled tokens.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token; needs logprobs: true."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra variables for the chat template (as vLLM); not the template itself "
        "(chat_template only with --trust-request-chat-template) nor the rendering switches: "
        + ", ".join(RESERVED_TEMPLATE_KWARGS)
        + ".",
    )
    tools: list[ChatTool] | None = Field(
        None, max_length=MAX_TOOLS, description="Functions the model may call (distinct names)."
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="Default auto with tools. required or a named function (one of tools) force "
        "a call and exclude response_format / guided_*; without tools only none or auto.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (required: exactly one)."
    )
    separate_reasoning: bool | None = Field(
        None,
        description="Return a leading <think> block as message.reasoning_content (default: the "
        "server's --reasoning).",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @property
    def output_limit(self) -> int | None:
        """max_tokens in effect: max_completion_tokens supersedes max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs 'logprobs': true")
        choice = self.tool_choice
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and not self.tools:
            raise ValueError("tool_choice: needs 'tools'")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if all(t.function.name != name for t in self.tools or ()):
                raise ValueError(f"tool_choice: names unknown function {name!r}")
        if forced and self.constraints():
            raise ValueError(
                "tool_choice: required or a named function cannot be combined with "
                "'response_format' or guided_* fields"
            )
        self.check_common(self.output_limit, forced)
        return self
