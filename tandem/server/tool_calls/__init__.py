"""Tool calls in model output text, whole or streamed, in the formats of FORMATS (one module
per family), plus the validation of a request's ``tools``, the JSON schemas that enforce
``tool_choice`` and the grammars that enforce ``strict`` tools under auto.

Model output never raises here: whatever does not parse as a tool call stays content."""

from tandem.server.tool_calls.base import (
    CallStart,
    Event,
    ToolCall,
    make_call_id,
    to_openai,
    to_openai_delta,
)
from tandem.server.tool_calls.detect import detect_format, keeps_special_tokens
from tandem.server.tool_calls.formats import FORMATS, HERMES_OPEN, MISTRAL_CALLS, PYTHON_TAG
from tandem.server.tool_calls.grammar import call_grammar, grammar_markers, single_token_ids
from tandem.server.tool_calls.schemas import (
    MAX_TOOLS,
    calls_from_required,
    is_strict,
    named_schema,
    required_schema,
    tool_parameters,
    validate_tools,
)
from tandem.server.tool_calls.streamer import (
    Parsed,
    ToolCallStreamer,
    parse_output,
    parse_tool_calls,
)

__all__ = [
    "FORMATS",
    "HERMES_OPEN",
    "MAX_TOOLS",
    "MISTRAL_CALLS",
    "PYTHON_TAG",
    "CallStart",
    "Event",
    "Parsed",
    "ToolCall",
    "ToolCallStreamer",
    "call_grammar",
    "calls_from_required",
    "detect_format",
    "grammar_markers",
    "is_strict",
    "keeps_special_tokens",
    "make_call_id",
    "named_schema",
    "parse_output",
    "parse_tool_calls",
    "required_schema",
    "single_token_ids",
    "to_openai",
    "to_openai_delta",
    "tool_parameters",
    "validate_tools",
]
