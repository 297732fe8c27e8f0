"""Which tool-call format a model writes, from its chat template (distinctive markers), else
its model_type; and how its output must be decoded."""

from __future__ import annotations

from tandem.server.tool_calls.formats import (
    DS_CALLS_BEGIN,
    GLM_KEY,
    HERMES_OPEN,
    KIMI_SECTION_BEGIN,
    MINIMAX_OPEN,
    MISTRAL_CALLS,
    QWEN_FUNCTION,
    QWEN_PARAMETER,
)
from tandem.server.tool_calls.harmony import CHANNEL

_LLAMA3_HINTS = ("<|python_tag|>", "ipython", "respond with a json for a function call")
_MODEL_TYPES = {  # model types whose format the type alone settles (before the older rules)
    "gpt_oss": "harmony",
    "kimi_k2": "kimi_k2",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm45",
    "minimax_m2": "minimax_m2",
}
# Formats whose markers are (or may be) special tokens, which a normal decode drops.
_KEEP_SPECIAL = frozenset(
    ("mistral", "harmony", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "minimax_m2")
)


def _from_template(template: str) -> str | None:
    if CHANNEL in template:
        return "harmony"
    if MINIMAX_OPEN in template:
        return "minimax_m2"
    if KIMI_SECTION_BEGIN in template:
        return "kimi_k2"
    if DS_CALLS_BEGIN in template:  # V3 / R1 wrap the arguments in ```json; V3.1 does not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if GLM_KEY in template:
        return "glm45"
    if HERMES_OPEN in template and QWEN_FUNCTION in template and QWEN_PARAMETER in template:
        return "qwen3_coder"
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_CALLS in template:
        return "mistral"
    lowered = template.lower()
    if any(hint in lowered for hint in _LLAMA3_HINTS):
        return "llama3_json"
    return None


def detect_format(chat_template: str | None, model_type: str | None = None) -> str | None:
    """The tool call format a model emits, from its chat template, else its model_type."""
    found = _from_template(chat_template or "")
    if found is not None:
        return found
    kind = (model_type or "").lower()
    if kind in _MODEL_TYPES:
        return _MODEL_TYPES[kind]
    if kind.startswith("qwen"):
        return "hermes"
    if kind.startswith(("mistral", "mixtral", "ministral")):
        return "mistral"
    if kind.startswith("llama"):
        return "llama3_json"
    return None


def keeps_special_tokens(fmt: str | None) -> bool:
    """Whether output in ``fmt`` must be decoded with special tokens kept: its markers are
    special tokens in the models that use it (or may be)."""
    return fmt in _KEEP_SPECIAL
