"""From chat messages to what a chat-shaped generation needs: the prompt's token ids (through
the model's chat template), the output constraint, and the shaper that splits the output into
reasoning, content and tool calls. Shared by chat completions, Anthropic Messages and
Responses, which differ only in how they spell the messages and the output."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.chat_history import check_request_template, normalize_messages, template_error
from tandem.server.chat_output import ChatOutput
from tandem.server.errors import RequestError
from tandem.server.guided import (
    ToolMode,
    after_reasoning,
    check_grammar,
    strict_tool_grammar,
    think_block,
    think_tag_ids,
)
from tandem.server.reasoning import starts_inside
from tandem.server.service import Service
from tandem.server.tool_calls import keeps_special_tokens


@dataclass
class ChatPlan:
    ids: list[int]  # the prompt
    guided: tuple[str, str] | None  # the output constraint (kind, spec)
    reasoning: bool  # a leading think block is split off as reasoning
    shaper: Callable[[], ChatOutput]  # one per choice
    keep_special: bool = False  # decode with special tokens kept (markers the shaper reads)


def render(
    svc: Service,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    *,
    continue_final: bool = False,
) -> list[int]:
    """The prompt's token ids, the history normalized first (``chat_history``: what strict
    templates accept). ``continue_final``: a trailing assistant message is continued (a
    prefill, as Anthropic's API has it), not closed. A template that fails is the request's
    fault (400 with its message)."""
    check_request_template(template_kwargs, svc.settings.trust_request_chat_template)
    messages = normalize_messages(messages)
    kwargs = dict(template_kwargs)
    if continue_final and messages and messages[-1]["role"] == "assistant":
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    try:
        return svc.tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # template errors (raise_exception too) are the request's fault
        raise template_error(e) from None


def think_budget_grammar(
    inside: bool, budget: int, param: str, ids: dict[str, int] | None = None
) -> tuple[str, str]:
    """A Lark grammar capping the leading think block at ``budget`` tokens: once they are
    spent, ``</think>`` is the only way on. The answer after it is free: any token, special
    ones too (a tool-call marker token must stay possible)."""
    ids = ids or {}
    tags = ",".join(str(ids[t]) for t in ("<think>", "</think>") if t in ids)
    if not tags:  # tags in several tokens: the answer is text (a token range could open one)
        block, rules = think_block(ids, inside=inside, budget=budget)
        return check_grammar("grammar", f"start: {block} REST\n{rules}REST: /(.|\\n)*/\n", param)
    closed, rules = think_block(ids, inside=True, budget=budget)  # "thought </think>"
    if inside:
        start = f"start: {closed} rest"
    elif "<think>" not in ids:  # an opening tag of several tokens, a closing one of one
        start = f"start: {think_block(ids, inside=False, budget=budget)[0]} rest"
    else:  # the block, or an answer whose first token is not a tag
        start = f"start: <[{ids['<think>']}]> {closed} rest | (<[^{tags}]> rest)?"
    # After the block any token but the tags (a second block would think past the budget).
    return check_grammar("grammar", f"{start}\n{rules}rest: <[^{tags}]>*\n", param)


def plan_chat(
    svc: Service,
    messages: list[dict[str, Any]],
    *,
    template_kwargs: dict[str, Any],
    tools: ToolMode | None,
    separate_reasoning: bool | None,
    guided: tuple[str, str] | None,
    guided_param: str,
    thinking_budget: int | None = None,
    continue_final: bool = False,
) -> ChatPlan:
    ids = render(svc, messages, template_kwargs, continue_final=continue_final)
    reasoning = svc.thinks if separate_reasoning is None else separate_reasoning
    if tools is not None and tools.choice == "auto" and svc.tool_format is None:
        raise RequestError(
            "this model's tool-call format is unknown (start the server with "
            "--tool-call-format); use tool_choice 'required' or a named function",
            param="tools",
        )
    tail = svc.tokenizer.decode(ids[-8:], skip_special_tokens=False)
    inside = reasoning and starts_inside(tail)
    if reasoning and guided is not None and guided[0] == "grammar" and inside:
        # A user grammar is the whole output: nothing of it is reasoning.
        reasoning = inside = False
    encode = functools.partial(svc.tokenizer.encode, add_special_tokens=False)
    think_ids = think_tag_ids(encode) if reasoning else {}
    if reasoning and guided is not None:
        # The model thinks freely first; the constraint holds after </think>.
        guided = after_reasoning(guided, inside, guided_param, think_ids)
    if tools is not None:  # strict tools under auto: calls in the model's format, schema-bound
        strict = strict_tool_grammar(
            tools, svc.tool_format, encode, reasoning=reasoning, inside=inside
        )
        if strict is not None:
            guided = strict
    if thinking_budget is not None and reasoning:
        if guided is not None:
            raise RequestError(
                "a thinking budget cannot be combined with a forced tool choice or an output "
                "constraint",
                param="thinking",
            )
        guided = think_budget_grammar(inside, thinking_budget, "thinking", think_ids)

    # harmony's channels (analysis = reasoning) are parsed with or without tools
    auto = tools is not None and tools.choice == "auto"
    fmt = svc.tool_format if auto or svc.tool_format == "harmony" else None

    def shaper() -> ChatOutput:
        return ChatOutput(reasoning=reasoning, inside=inside, tools=tools, fmt=fmt)

    # The shaper reads markers as text: a format's special tokens, and think tags where the
    # tokenizer marks them special (decoding would drop them, and the block never ends).
    hidden = [i for i in think_ids.values() if not svc.tokenizer.decode([i])]
    keep_special = keeps_special_tokens(fmt) or bool(reasoning and hidden)
    return ChatPlan(ids, guided, reasoning, shaper, keep_special)
