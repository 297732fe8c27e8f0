"""Per-request generation parameters, validated at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Constrained decoding: what `guided` may name ("grammar": Lark in llguidance's dialect, or
# GBNF; "choice": a JSON list of strings).
GUIDED_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
MAX_GUIDED_SPEC = 1 << 20  # characters


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` disable those
    filters. ``seed`` makes sampled output depend only on the seed and the inputs.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    # token id -> added logit (a dict or (id, bias) pairs; kept as sorted pairs)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) cannot end output before this
    # OpenAI's: subtract presence * [count > 0] + frequency * count over generated tokens;
    # vLLM's repetition_penalty: divide positive / multiply negative logits of every token
    # seen in the prompt or output.
    # Log-probabilities (under the model's raw distribution) of each sampled token and of the
    # ``logprobs`` most likely tokens at its position; None: not returned.
    logprobs: int | None = None
    # The same for every prompt token after the first (computed during prefill, so such a
    # request does not reuse cached prefixes).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (kind, spec): every output token must keep the output inside this grammar.
    guided: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias or ()
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            norm = tuple(sorted((t, b) for t, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
        for t, b in norm:
            _check_int("logit_bias", t, minimum=0)
            _check_float("logit_bias", b)
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        if len({t for t, _ in norm}) != len(norm):
            raise ValueError("logit_bias lists a token id twice")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in norm))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                _check_int(name, k, minimum=0)
                if k > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.guided is not None:
            g = tuple(self.guided)
            if len(g) != 2 or g[0] not in GUIDED_KINDS or not isinstance(g[1], str):
                raise ValueError(
                    f"guided must be (kind, spec) with kind one of {', '.join(GUIDED_KINDS)}"
                )
            if len(g[1]) > MAX_GUIDED_SPEC:
                raise ValueError(f"guided spec longer than {MAX_GUIDED_SPEC} characters")
            object.__setattr__(self, "guided", g)
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be combined with guided decoding (the grammar decides "
                    "where the output may end)"
                )
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """ValueError if a token id the parameters name is past the model's vocabulary."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is out of range [0, {vocab_size})")


def stop_token_set(
    params: SamplingParams, eos_token_ids: frozenset[int] | set[int]
) -> frozenset[int]:
    """Tokens that end this request's output (and are not part of its text)."""
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= eos_token_ids
    return frozenset(stop)


INT_MAX = 2**63 - 1  # every integer must travel to the engine process (msgpack: 64 bits)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > INT_MAX:
        raise ValueError(f"{name} must be <= {INT_MAX}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
