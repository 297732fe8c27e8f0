"""Grammar-constrained decoding state (llguidance), host side.

A request with ``SamplingParams.guided`` gets a matcher. Each step the scheduler asks every
constrained row's matcher for its allowed-token bitmask (after the matcher has consumed all of
the request's tokens so far) and the runner adds ``-inf`` outside it before sampling. The
matcher consumes each finalized token; a grammar that has completed stops its request.

Compiling a grammar may take a while for large schemas; matchers are compiled once per
distinct (kind, text) and copied per request.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import numpy as np

from tandem.sampling_params import GUIDED_KINDS

_CACHE_SIZE = 64
# JSON as Python's json.dumps writes it: no free whitespace (a sampled model could otherwise
# pad forever). A schema's "x-guidance" object overrides these (llguidance's options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def words_for(vocab_size: int) -> int:
    """int32 words of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar for a guided request; ValueError names a malformed spec."""
    import llguidance

    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("json_schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)
    if kind == "choice":
        try:
            options = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"choice is not valid JSON: {e}") from None
        if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
            raise ValueError("choice must be a non-empty list of strings")
        return llguidance.grammar_from("choice", spec)
    raise ValueError(f"unknown guided decoding kind {kind!r}; one of {', '.join(GUIDED_KINDS)}")


class GrammarCompiler:
    """Builds matchers for one tokenizer (any Hugging Face fast tokenizer)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        import llguidance.hf

        # The grammar's end token: the tokenizer's own EOS if it is one of the stop ids
        # (e.g. <|im_end|> for a chat model), else the lowest. The scheduler also allows a
        # request's other stop tokens wherever the grammar allows its end.
        own = getattr(hf_tokenizer, "eos_token_id", None)
        eos = own if own in eos_token_ids else min(eos_token_ids, default=None)
        self.eos = eos
        self.words = words_for(vocab_size)
        self._tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def matcher(self, kind: str, spec: str) -> Matcher:
        """A fresh matcher at the grammar's start; ValueError if the grammar is invalid."""
        import llguidance

        key = (kind, spec)
        template = self._cache.get(key)
        if template is None:
            grammar = grammar_text(kind, spec)
            template = llguidance.LLMatcher(self._tok, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid {kind}: {template.get_error().strip()}")
            self._cache[key] = template
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Matcher(template.deep_copy(), self.words, self.eos)


class Matcher:
    """One request's grammar state."""

    def __init__(self, matcher: Any, words: int, eos: int | None = None) -> None:
        self._m = matcher
        self.words = words
        self.eos = eos
        self.consumed = 0

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (int32, ``words`` long)."""
        assert out.size == self.words, "mask row of the wrong width"
        if self._m.is_error():
            out[:] = -1  # the request is failing; its token is discarded
            return
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar rejects it."""
        self.consumed += 1
        return bool(self._m.consume_token(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar would accept in a row (nothing consumed)."""
        if self._m.is_error():
            return 0
        return int(self._m.validate_tokens(tokens))

    def masks_after(self, tokens: tuple[int, ...], out: list[np.ndarray]) -> None:
        """``out[i]`` = the allowed tokens after ``tokens[:i + 1]`` (each valid in turn,
        see ``valid_prefix``); the matcher is rolled back to where it was."""
        consumed = 0
        try:
            for i, row in enumerate(out):
                ok = self._m.consume_token(tokens[i])
                assert ok, f"a proposed token the grammar rejects: {tokens[i]}"
                consumed += 1
                self.fill(row)
        finally:
            if consumed:
                self._m.rollback(consumed)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end of output."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


# From this many constrained rows, masks and token consumption go to llguidance's thread pool
# (0: never, the default: for JSON-schema masks on the H200's host it was slower, 0.87 vs
# 0.58 ms a step at 32 rows; docs/benchmarks.md "Guided decoding").
PARALLEL_MIN = int(os.environ.get("TANDEM_GRAMMAR_PARALLEL_MIN", "0")) or 1 << 62
_executor: Any = None


def _pool() -> Any:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def fill_masks(matchers: list[Matcher | None], out: np.ndarray) -> None:
    """``out[i]`` = the allowed next tokens of ``matchers[i]``; rows whose matcher is None or
    failed are left as they are (the caller fills them with -1: all allowed)."""
    live = [(i, m) for i, m in enumerate(matchers) if m is not None and not m._m.is_error()]
    if len(live) < PARALLEL_MIN:
        for i, m in live:
            m.fill(out[i])
        return
    assert out.flags["C_CONTIGUOUS"] and out.dtype == np.int32
    assert out.shape[1] == live[0][1].words, "mask rows of the wrong width"
    _pool().unsafe_compute_mask_ptr(
        [(m._m, i) for i, m in live], out.ctypes.data, out.shape[1] * 4, out.shape[0]
    )


def accept_all(pairs: list[tuple[Matcher, int]]) -> list[bool]:
    """Consume one token per matcher (in parallel for many); False where rejected."""
    if len(pairs) < PARALLEL_MIN:
        return [m.accept(t) for m, t in pairs]
    for m, _ in pairs:
        m.consumed += 1
    return [bool(ok) for ok in _pool().consume_token_par([(m._m, t) for m, t in pairs])]


def allowed(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bitmask row → bool array over the vocabulary (tests, debugging)."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
