"""Validate OpenAI request bodies into plain dataclasses. Fields Tandem does not implement are
rejected (400 naming the field) unless they carry their neutral value; nothing is accepted
and ignored."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.server.errors import RequestError
from tandem.server.guided import (
    GUIDED_FIELDS,
    ToolMode,
    guided_source,
    parse_guided,
    parse_tools,
    tool_grammar,
)

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 16
MAX_MESSAGES = 1024


# Neutral values of fields later issues implement: accepted only as these.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (None, 0),
    # Completions have no tools (chat parses them).
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
}
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "logprobs",
    "prompt_logprobs",
    "min_p",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "return_token_ids",
    "response_format",
    *GUIDED_FIELDS,
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "chat_template_kwargs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "separate_reasoning",
}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
ROLES = ("system", "developer", "user", "assistant", "tool")


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


def _check_fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _NEUTRAL:
            if not any(_same(value, n) for n in _NEUTRAL[key]):
                raise RequestError(f"'{key}' is not supported yet", param=key)
            continue
        raise RequestError(f"unknown field '{key}'", param=key)
    return body


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same JSON type (False is not 0, 0.0 is not 0)."""
    return type(a) is type(b) and a == b


def _flag(body: dict[str, Any], key: str) -> bool:
    """An optional boolean field (absent or null: False)."""
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", param=key)
    return value


def _number(body: dict[str, Any], key: str, *, integer: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)):
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}", param=key)
    return v


def _max_tokens(body: dict[str, Any], key: str) -> int | None:
    value = _number(body, key, integer=True)
    if value is not None and value < 1:
        zero = " (0 only with echo on /v1/completions)" if key == "max_tokens" else ""
        raise RequestError(f"'{key}' must be at least 1{zero}", param=key)
    return value


def _common(body: dict[str, Any], max_tokens_key: str = "max_tokens") -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    max_tokens = _max_tokens(body, max_tokens_key)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise RequestError("'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise RequestError(
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters",
            param="stop",
        )
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - STREAM_OPTIONS):
        raise RequestError(
            "'stream_options' supports only include_usage and continuous_usage_stats",
            param="stream_options",
        )
    include_usage = _flag(opts, "include_usage") if opts else False
    continuous_usage = _flag(opts, "continuous_usage_stats") if opts else False
    sampling: dict[str, Any] = {}
    for key in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if (v := _number(body, key)) is not None:
            sampling[key] = float(v)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            isinstance(k, str)
            and k.isascii()
            and k.isdigit()
            and len(k) <= 19
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            for k, v in bias.items()
        ):
            raise RequestError(
                "'logit_bias' must map token ids (as strings) to numbers", param="logit_bias"
            )
        sampling["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
    for key in ("top_k", "seed", "min_tokens"):
        if (v := _number(body, key, integer=True)) is not None:
            sampling[key] = v
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise RequestError(
                "'stop_token_ids' must be a list of integers", param="stop_token_ids"
            )
        sampling["stop_token_ids"] = tuple(ids)
    if (ignore := body.get("ignore_eos")) is not None:
        if not isinstance(ignore, bool):
            raise RequestError("'ignore_eos' must be a boolean", param="ignore_eos")
        sampling["ignore_eos"] = ignore
    return_ids = _flag(body, "return_token_ids")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("'user' must be a string", param="user")
    try:  # validate the values now; max_tokens is set per prompt later
        SamplingParams(**{**sampling, "max_tokens": max(1, sampling.get("min_tokens", 0))})
    except ValueError as e:
        name = next((k for k in sampling if k in str(e)), None)
        raise RequestError(str(e), param=name) from None
    plp = body.get("prompt_logprobs")
    if plp is not None:
        if isinstance(plp, bool) or not isinstance(plp, int) or not 0 <= plp <= MAX_LOGPROBS:
            raise RequestError(
                f"'prompt_logprobs' must be an integer from 0 to {MAX_LOGPROBS}",
                param="prompt_logprobs",
            )
        sampling["prompt_logprobs"] = plp
    guided = parse_guided(body)
    if guided is not None:
        sampling["guided"] = guided
    n = _number(body, "n", integer=True)
    if n is not None and not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be between 1 and {MAX_N}", param="n")
    return {
        "n": n or 1,
        "model": model,
        "params": None,
        "max_tokens": max_tokens,
        "stop": stops,
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous_usage,
        "sampling": sampling,
        "return_token_ids": return_ids,
        "guided_param": guided_source(body),
    }


def parse_completion(body: Any, vocab_size: int) -> CompletionRequest:
    body = _check_fields(body, COMPLETION_FIELDS)
    # max_tokens 0 with echo scores the prompt (older OpenAI-style scorers send it): one
    # token is generated internally and dropped, nothing of it is returned or counted.
    score_only = _same(body.get("max_tokens"), 0) and _flag(body, "echo")
    if score_only:
        body = {**body, "max_tokens": 1}
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) for p in prompt)
        or (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(p, list)
                and p
                and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompt
            )
        )
    ):
        prompts = list(prompt)
    else:
        raise RequestError(
            "'prompt' must be a non-empty string, list of strings, list of "
            "token ids or list of token-id lists",
            param="prompt",
        )
    suffix = _suffix(body, prompts)
    for p in prompts:
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        if isinstance(p, str) and not p and suffix is None:  # FIM: the cursor may be first
            raise RequestError("'prompt' must not be empty", param="prompt")
    common = _common(body)
    k = body.get("logprobs")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise RequestError(
                f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", param="logprobs"
            )
        common["sampling"]["logprobs"] = k
    echo = _flag(body, "echo")
    if echo and k is not None:
        common["sampling"].setdefault("prompt_logprobs", k)
    best_of = _number(body, "best_of", integer=True)
    if best_of is not None:
        if not common["n"] <= best_of <= MAX_N:
            raise RequestError(
                f"'best_of' must be between n ({common['n']}) and {MAX_N}", param="best_of"
            )
        if common["stream"] and best_of > common["n"]:
            raise RequestError("'best_of' cannot be streamed", param="best_of")
    if score_only and common["sampling"].get("min_tokens"):
        raise RequestError("'min_tokens' must be 0 when max_tokens is 0", param="min_tokens")
    if score_only and best_of is not None and best_of > common["n"]:
        raise RequestError("'best_of' needs max_tokens of at least 1", param="best_of")
    return CompletionRequest(
        **common,
        prompts=prompts,
        echo=echo,
        best_of=best_of,
        score_only=score_only,
        suffix=suffix,
    )


def _suffix(body: dict[str, Any], prompts: list[str | list[int]]) -> str | None:
    """Fill-in-the-middle's text after the cursor (None or "": a plain completion). Every
    prompt must be text, and echo is refused: which text would it echo?"""
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise RequestError("'suffix' must be a string", param="suffix")
    if not suffix:
        return None
    if any(isinstance(p, list) for p in prompts):
        raise RequestError("'suffix' needs a text prompt, not token ids", param="suffix")
    if _flag(body, "echo"):
        raise RequestError("'echo' cannot be combined with 'suffix'", param="suffix")
    return suffix


def parse_chat(body: Any) -> ChatRequest:
    body = _check_fields(body, CHAT_FIELDS)
    key = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else ("max_tokens")
    )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"at most {MAX_MESSAGES} messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise RequestError(
                f"messages[{i}].{sorted(extra)[0]} is not supported", param=f"messages[{i}]"
            )
        msg: dict[str, Any] = {"role": m["role"]}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise RequestError(
                    f"messages[{i}].tool_calls is only for assistant messages",
                    param=f"messages[{i}].tool_calls",
                )
            msg["tool_calls"] = _history_tool_calls(m["tool_calls"], i)
        if m.get("tool_call_id") is not None:
            if m["role"] != "tool" or not isinstance(m["tool_call_id"], str):
                raise RequestError(
                    f"messages[{i}].tool_call_id must be a string on a tool message",
                    param=f"messages[{i}].tool_call_id",
                )
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise RequestError(
                    f"messages[{i}].name must be a string", param=f"messages[{i}].name"
                )
            msg["name"] = m["name"]
        content = m.get("content")
        if content is None and "tool_calls" in msg:
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict)
                and set(p) == {"type", "text"}
                and p["type"] == "text"
                and isinstance(p["text"], str)
                for p in content
            ):
                raise RequestError(
                    f"messages[{i}].content parts must be text", param=f"messages[{i}].content"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(
                f"messages[{i}].content must be a string", param=f"messages[{i}].content"
            )
        msg["content"] = content
        out.append(msg)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if key == "max_completion_tokens":
        _max_tokens(body, "max_tokens")  # validated, superseded
    common = _common(body, key)
    tools = parse_tools(body, common["sampling"].get("guided"))
    if tools is not None:
        if tools.choice != "none":
            kwargs = {**kwargs, "tools": list(tools.tools)}
        forced = tool_grammar(tools)
        if forced is not None:
            common["sampling"]["guided"] = forced
            common["guided_param"] = "tool_choice"
    separate = body.get("separate_reasoning")
    if separate is not None and not isinstance(separate, bool):
        raise RequestError("'separate_reasoning' must be a boolean", param="separate_reasoning")
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise RequestError("'logprobs' must be a boolean", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise RequestError(
                f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}",
                param="top_logprobs",
            )
        if not want:
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if want:
        common["sampling"]["logprobs"] = top or 0
    return ChatRequest(
        **common,
        messages=out,
        template_kwargs=kwargs,
        tools=tools,
        separate_reasoning=separate,
    )


def _history_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, for the chat template (arguments as objects,
    the form Hugging Face templates expect)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{param} must be a list", param=param)
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or set(c) - {"id", "type", "function"}
            or set(fn) - {"name", "arguments"}
            or c.get("type", "function") != "function"
            or not isinstance(c.get("id", ""), str)
        ):
            raise RequestError(
                f"{param} entries must be {{id, type: function, function: {{name, arguments}}}}",
                param=param,
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"{param} arguments must be JSON", param=param) from None
        if not isinstance(args, dict):
            raise RequestError(f"{param} arguments must be a JSON object", param=param)
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
        }
        if "id" in c:
            entry["id"] = c["id"]
        out.append(entry)
    return out
