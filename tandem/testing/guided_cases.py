"""Guided-decoding cases for tests and benchmarks: each a (kind, spec) and a checker that
says whether a finished output satisfies it. Bounded (maxLength, maxItems, enums, ranges) so
that a random-weight model, which the grammar alone keeps in line, finishes in few tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema


@dataclass(frozen=True)
class GuidedCase:
    name: str
    kind: str
    spec: str
    check: Callable[[str], bool]
    # The grammar itself ends after a bounded number of tokens (else a long random output may
    # run into max_tokens: valid only as a prefix).
    bounded: bool = True

    @property
    def guided(self) -> tuple[str, str]:
        return (self.kind, self.spec)


def _schema_case(name: str, schema: dict) -> GuidedCase:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    return GuidedCase(name, "json_schema", json.dumps(schema), check)


def _regex_case(name: str, pattern: str) -> GuidedCase:
    return GuidedCase(name, "regex", pattern, lambda t: re.fullmatch(pattern, t) is not None)


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


_STR = {"type": "string", "maxLength": 6}
_INT = {"type": "integer", "minimum": -999, "maximum": 999}  # "number" has unbounded digits
SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": _STR,
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -50, "maximum": 50},
            "point": {
                "type": "object",
                "properties": {"x": _INT, "y": _INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "labels": {"type": "array", "items": _STR, "maxItems": 2},
        },
        "required": ["id", "point", "labels"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "string", "enum": ["yes", "no"]},
            {"type": "null"},
        ]
    },
    "const_and_optional": {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "note": _STR},
        "required": ["kind"],
        "additionalProperties": False,
    },
    "tuple_like": {
        "type": "array",
        "prefixItems": [{"type": "boolean"}, {"type": "integer", "minimum": 1, "maximum": 3}],
        "items": False,
        "minItems": 2,
    },
    "string_pattern": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{2}$"},
}

CASES: list[GuidedCase] = [
    *(_schema_case(name, s) for name, s in SCHEMAS.items()),
    GuidedCase("json_object", "json_object", "", _json_object, bounded=False),
    _regex_case("date", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"),
    _regex_case("phone", r"\+1 \([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    _regex_case("word_list", r"(cat|dog|bird)(, (cat|dog|bird)){0,3}\."),
    GuidedCase(
        "choice",
        "choice",
        json.dumps(["alpha", "beta", "gamma"]),
        lambda t: t in {"alpha", "beta", "gamma"},
    ),
    GuidedCase(
        "lark",
        "grammar",
        'start: "(" num (" + " num){0,3} ")"\nnum: /[1-9][0-9]?/',
        lambda t: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?){0,3}\)", t) is not None,
    ),
    GuidedCase(
        "gbnf",
        "grammar",
        'root ::= "answer: " ("yes" | "no")',
        lambda t: t in {"answer: yes", "answer: no"},
    ),
]


def random_schema(rng, depth: int = 0) -> dict:
    """A random bounded JSON schema (objects, arrays, enums, ranges, strings, anyOf): every
    sentence of it is short, so a random model finishes it."""
    kinds = ["integer", "boolean", "string", "enum", "const", "null"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["a", "bb", "ccc", "dd d", "é", "x-y"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["on", "off", 7, True])}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 2),
        }
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "ok", "value", "kind", "child"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def random_schema_case(rng) -> GuidedCase:
    schema = random_schema(rng)
    return _schema_case(f"random-{rng.getrandbits(32):08x}", schema)
