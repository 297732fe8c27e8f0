"""OpenAI generation requests in the form the routes run them: plain dataclasses built from the
validated bodies (``openai_schema``). What a schema cannot check happens here, right after
validation: a constraint's grammar and the tool choice (``guided``), prompt token ids against
the vocabulary, and the engine's own checks of the sampling values (``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tandem.sampling_params import SamplingParams
from tandem.server import openai_schema as o
from tandem.server.errors import RequestError, invalid_body
from tandem.server.guided import (
    GUIDED_FIELDS,
    ToolMode,
    guided_source,
    parse_guided,
    parse_tools,
    tool_grammar,
)
from tandem.server.openai_chat_schema import (
    AssistantMessage,
    ChatMessage,
    NamedToolChoice,
    ToolCall,
    ToolMessage,
)

Body = TypeVar("Body", bound=BaseModel)


@dataclass
class GenerationRequest:
    model: str | None
    params: SamplingParams | None  # max_tokens filled in once the prompt length is known
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False  # extension (as in vLLM): token ids in each choice
    guided_param: str = "response_format"  # the field the output constraint came from
    n: int = 1  # samples per prompt
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output
    best_of: int | None = None  # completions: sample this many, return the n most likely
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    score_only: bool = False  # max_tokens 0 with echo: the prompt (and its logprobs) only
    suffix: str | None = None  # fill-in-the-middle: each (text) prompt is the prefix


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolMode | None = None
    separate_reasoning: bool | None = None  # None: the server's default


def validate(model: type[Body], body: Any) -> Body:
    """``body`` (parsed JSON) as ``model``; a RequestError naming the field if it is not one."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_body(e.errors()) from None


def parse_completion(body: Any, vocab_size: int) -> CompletionRequest:
    return completion_request(validate(o.CompletionRequest, body), vocab_size)


def parse_chat(body: Any) -> ChatRequest:
    return chat_request(validate(o.ChatCompletionRequest, body))


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _common(body: o.GenerationBody, max_tokens: int | None) -> dict[str, Any]:
    """The fields both endpoints share, as ``GenerationRequest``'s arguments."""
    sampling: dict[str, Any] = {k: v for k in _FLOATS if (v := getattr(body, k)) is not None}
    if body.logit_bias is not None:
        sampling["logit_bias"] = {int(k): v for k, v in body.logit_bias.items()}
    for key in ("top_k", "seed", "min_tokens"):
        if (v := getattr(body, key)) is not None:
            sampling[key] = v
    if body.stop_token_ids is not None:
        sampling["stop_token_ids"] = tuple(body.stop_token_ids)
    if body.ignore_eos is not None:
        sampling["ignore_eos"] = body.ignore_eos
    try:  # the engine's own checks (e.g. a logit_bias id past 64 bits)
        SamplingParams(**{**sampling, "max_tokens": max(1, sampling.get("min_tokens", 0))})
    except ValueError as e:
        name = next((k for k in sampling if k in str(e)), None)
        raise RequestError(str(e), param=name) from None
    if body.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = body.prompt_logprobs
    constraint: dict[str, Any] = {k: getattr(body, k) for k in GUIDED_FIELDS}
    if body.response_format is not None:
        constraint["response_format"] = body.response_format.model_dump(
            by_alias=True, exclude_unset=True
        )
    guided = parse_guided(constraint)  # compiles the grammar: a bad one is a 400 naming it
    if guided is not None:
        sampling["guided"] = guided
    stop = body.stop
    opts = body.stream_options
    return {
        "n": body.n or 1,
        "model": body.model,
        "params": None,
        "max_tokens": max_tokens,
        "stop": [] if stop is None else [stop] if isinstance(stop, str) else list(stop),
        "stream": bool(body.stream),
        "include_usage": bool(opts and opts.include_usage),
        "continuous_usage": bool(opts and opts.continuous_usage_stats),
        "sampling": sampling,
        "return_token_ids": bool(body.return_token_ids),
        "guided_param": guided_source(constraint),
    }


def completion_request(body: o.CompletionRequest, vocab_size: int) -> CompletionRequest:
    # max_tokens 0 (the schema allows it only with echo) scores the prompt, as older
    # OpenAI-style scorers ask: one token is generated internally and dropped, nothing of it
    # is returned or counted.
    score_only = body.max_tokens == 0
    prompts = body.prompts()
    for p in prompts:
        if isinstance(p, list) and any(t >= vocab_size for t in p):
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    common = _common(body, 1 if score_only else body.max_tokens)
    if body.logprobs is not None:
        common["sampling"]["logprobs"] = body.logprobs
        if body.echo:
            common["sampling"].setdefault("prompt_logprobs", body.logprobs)
    return CompletionRequest(
        **common,
        prompts=prompts,
        echo=bool(body.echo),
        best_of=body.best_of,
        score_only=score_only,
        suffix=body.suffix or None,
    )


def chat_request(body: o.ChatCompletionRequest) -> ChatRequest:
    common = _common(body, body.output_limit)
    sampling = common["sampling"]
    choice = body.tool_choice
    tools = parse_tools(
        {
            "tools": None
            if body.tools is None
            else [t.model_dump(exclude_unset=True) for t in body.tools],
            "tool_choice": choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
            "parallel_tool_calls": body.parallel_tool_calls,
        },
        sampling.get("guided"),
    )
    kwargs = dict(body.chat_template_kwargs or {})
    if tools is not None:
        if tools.choice != "none":
            kwargs["tools"] = list(tools.tools)
        forced = tool_grammar(tools)
        if forced is not None:
            sampling["guided"] = forced
            common["guided_param"] = "tool_choice"
    if body.logprobs:
        sampling["logprobs"] = body.top_logprobs or 0
    return ChatRequest(
        **common,
        messages=[_message(m) for m in body.messages],
        template_kwargs=kwargs,
        tools=tools,
        separate_reasoning=body.separate_reasoning,
    )


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template gets it: content a string (text parts joined), earlier
    tool calls with their arguments as objects (the form Hugging Face templates expect)."""
    msg: dict[str, Any] = {"role": m.role}
    if isinstance(m, AssistantMessage) and m.tool_calls is not None:
        msg["tool_calls"] = [_history_call(c) for c in m.tool_calls]
    if isinstance(m, AssistantMessage) and (m.reasoning_content or m.reasoning):
        msg["reasoning_content"] = m.reasoning_content or m.reasoning
    if isinstance(m, ToolMessage) and m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        msg["name"] = m.name
    content = m.content
    if isinstance(content, list):
        content = "".join(p.text for p in content)
    msg["content"] = content or ""  # None only beside tool_calls
    return msg


def _history_call(c: ToolCall) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "function",
        "function": {"name": c.function.name, "arguments": c.function.arguments},
    }
    if c.id is not None:
        entry["id"] = c.id
    return entry
