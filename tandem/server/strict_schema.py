"""Building blocks of the strict request schemas (OpenAI's generation bodies): a strict base
model, unions picked by a discriminator, and fields whose errors are one message.

A union's member is picked by a discriminator rather than tried in turn, so an error names one
member's field (``messages[2].content[0].text``) instead of listing every member's. Members
are tagged with capitalized names, which the error handler (``errors.invalid_body``) leaves
out of the path it reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError, WrapValidator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def tagged(key: str, *models: type[BaseModel]) -> Any:
    """A union of models picked by their ``key`` field (a Literal); a value naming no member
    is one error at ``key``."""
    tags = {v: m.__name__ for m in models for v in get_args(m.model_fields[key].annotation)}

    def pick(value: Any) -> str | None:
        tag = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        return tags.get(tag) if isinstance(tag, str) else None

    union = Union[tuple(Annotated[m, Tag(m.__name__)] for m in models)]  # noqa: UP007
    # The message starts with the field it is about (the error handler adds it to the path).
    expected = f"{key}: must be one of {', '.join(tags)}"
    return Annotated[
        union,
        Discriminator(pick, custom_error_type="invalid_tag", custom_error_message=expected),
    ]


_JSON_TYPES = ((bool, "Boolean"), (str, "String"), (list, "Array"), (dict, "Object"))


def by_json_type(expected: str, **members: Any) -> Any:
    """A union picked by the value's JSON type (members named String, Array, Object,
    Boolean); a value of another type is one error: it must be ``expected``."""

    def pick(value: Any) -> str | None:
        name = next((n for t, n in _JSON_TYPES if isinstance(value, t)), None)
        return name if name in members else None

    union = Union[tuple(Annotated[t, Tag(name)] for name, t in members.items())]  # noqa: UP007
    return Annotated[
        union,
        Discriminator(
            pick, custom_error_type="wrong_json_type", custom_error_message=f"must be {expected}"
        ),
    ]


def whole(message: str) -> WrapValidator:
    """Any error inside the field is reported once, at the field, as ``message``."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(message) from None

    return WrapValidator(validate)


def neutral(kind: Any, values: str) -> Any:
    """A field Tandem does not implement here: accepted only at its neutral value."""
    return Annotated[kind, whole(f"not supported here (only {values})")]
