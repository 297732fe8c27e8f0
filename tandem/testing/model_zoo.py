"""Tiny random-weight models of every text architecture the installed mlx-lm ships.

``tiny_config(model_type)`` reads ``mlx_lm.models.<type>.ModelArgs`` (a dataclass) and fills
its fields by name from ``SIZES`` (hidden 64, 4 heads, 2 KV heads, head_dim 16, 4 experts of
which 2 are routed, MLA ranks of 32, sliding windows of 8, ...), shrinks layer patterns so 2-4
layers hold one layer of each kind, and applies the per-type ``OVERRIDES`` the heuristics
cannot guess. Wrappers whose ModelArgs nest a ``text_config`` get one built the same way from
their text arguments class. ``make_zoo_model`` writes it with float32 random weights and the
tiny tokenizer of ``tiny_models``; mlx-lm's ``load`` loads it like a real checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import math
import re
import typing
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

# isort: off
import tandem.runner  # noqa: F401  (preloads an optimized BLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from tandem.testing import tiny_models as tm
from tandem.testing.zoo_tables import (
    LAYER_COUNTS,
    LAYER_PATTERNS,
    NOT_TEXT,
    OVERRIDES,
    REQUIRED,
    SANITIZED,
    SIZES,
    TEXT_ARGS,
    UNBUILDABLE,
    VOCAB,
)

# isort: on

# Modules of mlx_lm/models that hold shared layers, not a model type.
HELPERS: frozenset[str] = frozenset(
    {
        "__init__",
        "activations",
        "base",
        "bitlinear_layers",
        "cache",
        "gated_delta",
        "mla",
        "pipeline",
        "rope_utils",
        "ssm",
        "switch_layers",
    }
)


def model_types() -> list[str]:
    """Every module of the installed mlx-lm's ``models`` package but the helpers."""
    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    return sorted(p.stem for p in folder.glob("*.py") if p.stem not in HELPERS)


def _module(model_type: str) -> ModuleType:
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


_NO_VALUE = "<no tiny value>"


def _guess(cls: type, field: dataclasses.Field) -> Any:
    """A value for a required field no table names, from its annotation (``_NO_VALUE``
    where none fits: an override must give it)."""
    hint = typing.get_type_hints(cls).get(field.name, field.type)
    origin = typing.get_origin(hint) or hint
    args = typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return None
    if origin is bool:
        return False
    if origin in (list, tuple):
        return []
    if origin is dict:
        return {}
    return _NO_VALUE


def _fill(cls: type, model_type: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        default = _default(field)
        if field.name == "model_type":
            config[field.name] = model_type
        elif field.name in SIZES and not (type(default) is int and default == 0):
            config[field.name] = SIZES[field.name]
        elif default is dataclasses.MISSING and field.name in REQUIRED:
            config[field.name] = REQUIRED[field.name]
        elif default is dataclasses.MISSING:
            config[field.name] = _guess(cls, field)
        elif field.name == "tie_word_embeddings":
            config[field.name] = default
    return config


def text_args(model_type: str) -> tuple[type, str] | None:
    """The arguments class of a wrapper's ``text_config`` and the model type to give it;
    None when ``model_type`` has no ``text_config``."""
    module = _module(model_type)
    if "text_config" not in {f.name for f in dataclasses.fields(module.ModelArgs)}:
        return None
    if model_type in TEXT_ARGS:
        inner = TEXT_ARGS[model_type]
        found = text_args(inner)
        return found if found else (_module(inner).ModelArgs, inner)
    for name in ("TextArgs", "TextConfig", "TextModelArgs"):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            inner = cls.__module__.rsplit(".", 1)[-1]
            return cls, inner if inner != model_type else f"{model_type}_text"
    source = inspect.getsource(module)
    match = re.search(r"(\w+)\.ModelArgs\.from_dict\(\s*\w+\.text_config", source)
    if match:
        return _module(match.group(1)).ModelArgs, match.group(1)
    raise ValueError(f"{model_type}: cannot tell the class of its text_config")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _sync_layers(config: dict[str, Any], given: dict[str, Any]) -> None:
    """A per-layer pattern given without a layer count sets the layer count."""
    if any(k in given for k in LAYER_COUNTS):
        return
    for key in LAYER_PATTERNS:
        if isinstance(given.get(key), (list, str)):
            for k in LAYER_COUNTS:
                if k in config:
                    config[k] = len(given[key])
            return


def _cover_layer_kinds(cls: type, config: dict[str, Any], given: dict[str, Any]) -> None:
    """Where ModelArgs derives ``layer_types`` from the layer count (e.g. three sliding
    layers, then a full one), take the fewest layers (2-4) that give two kinds."""
    names = {f.name for f in dataclasses.fields(cls)}
    key = next((k for k in LAYER_COUNTS if k in config), None)
    if "layer_types" not in names or key is None:
        return
    if any(k in given for k in (*LAYER_COUNTS, *LAYER_PATTERNS)):
        return
    for n in (2, 3, 4):
        try:
            args = cls.from_dict(copy.deepcopy({**config, key: n}))
        except Exception:  # noqa: BLE001 - whatever ModelArgs rejects: keep the count
            return
        kinds = getattr(args, "layer_types", None)
        if not kinds or len(set(kinds)) > 1:
            config[key] = n
            return


def tiny_config(model_type: str) -> dict[str, Any]:
    """A small config of ``model_type`` that ``mlx_lm``'s ModelArgs accepts."""
    if model_type in NOT_TEXT:
        raise ValueError(f"{model_type} is not a text model: {NOT_TEXT[model_type]}")
    if model_type in UNBUILDABLE:
        raise ValueError(f"{model_type} is {UNBUILDABLE[model_type]}")
    module = _module(model_type)
    config = _fill(module.ModelArgs, model_type)
    override = OVERRIDES.get(model_type, {})
    found = text_args(model_type)
    if found is not None:
        cls, inner_type = found
        text = _fill(cls, inner_type)
        given = override.get("text_config", {})
        text = _merge(text, given)
        _sync_layers(text, given)
        _cover_layer_kinds(cls, text, given)
        config["text_config"] = text
    config = _merge(config, override)
    _sync_layers(config, override)
    _cover_layer_kinds(module.ModelArgs, config, override)
    config.setdefault("vocab_size", VOCAB)  # the tokenizer's size, where a wrapper nests it
    unset = [k for k, v in config.items() if v == _NO_VALUE]
    unset += [
        f"text_config.{k}" for k, v in config.get("text_config", {}).items() if v == _NO_VALUE
    ]
    if unset:
        raise ValueError(f"no tiny value for required field(s) {', '.join(unset)}")
    return copy.deepcopy(config)


def _owners(model: nn.Module) -> dict[str, str]:
    """Parameter name -> class name of the module holding it."""
    modules = dict(model.named_modules())
    out = {}
    for name, _ in tree_flatten(model.parameters()):
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        out[name] = type(owner).__name__ if owner is not None else ""
    return out


def _zoo_init(model: nn.Module, vocab: int, seed: int) -> tm.Init:
    """Linears 1/sqrt(fan_in), their biases 0.1, embeddings 1 (0.2 when tied to the output)
    and the final norm a zero-mean scale of std 1, as in ``tiny_models.init_std``; matrices
    mlx-lm initializes to zeros (bare output heads) get 1/sqrt(fan_in) too. Every other
    parameter (layer norms, convolutions, SSM decays, sinks, gains) keeps the value mlx-lm's
    own init gives it."""
    own = dict(tree_flatten(model.parameters()))
    owners = _owners(model)
    heads = [
        k
        for k, v in own.items()
        if v.ndim == 2 and v.shape[0] == vocab and "Embedding" not in owners[k]
    ]
    tied = not heads

    def uniform(name: str, shape: tuple[int, ...], std: float) -> mx.array:
        key = mx.random.key(zlib.crc32(name.encode()) + seed)
        return mx.random.uniform(-std * 3**0.5, std * 3**0.5, shape, key=key)

    def init(name: str, shape: tuple[int, ...]) -> float | mx.array | None:
        owner = owners.get(name, "")
        leaf = name.rsplit(".", 1)[-1]
        value = own[name]
        if "Embedding" in owner and len(shape) == 2:
            return 0.2 if tied else 1.0
        if "Linear" in owner and leaf == "weight" and len(shape) >= 2:
            return 1.0 / math.sqrt(shape[-1])
        if "Linear" in owner and leaf == "bias":
            return 0.1
        if len(shape) >= 2 and not bool(mx.any(value != 0)):
            return 1.0 / math.sqrt(shape[-1])
        if "Norm" in owner and leaf == "weight" and not re.search(r"\.\d+\.", name):
            # The final norm (outside the layer stack). Against its own init, which is 1 or
            # 0 for the norms that scale by (1 + weight): zero mean either way.
            return value - 1.0 + uniform(name, shape, 1.0)
        return value

    return init


def _vocab(config: dict[str, Any]) -> int:
    return int(config.get("text_config", {}).get("vocab_size") or config["vocab_size"])


@functools.cache
def _model_class(model_type: str) -> tuple[type, type]:
    module = _module(model_type)
    return module.Model, module.ModelArgs


def check_loaded(path: Path, model: nn.Module, model_type: str) -> None:
    """Raise unless ``model`` (loaded from ``path``) holds the weights written there: a
    sanitize() that moves, stacks or drops what it was given breaks the tiny model."""
    written: dict[str, mx.array] = {}
    for file in sorted(Path(path).glob("model*.safetensors")):
        written.update(mx.load(str(file)))
    loaded = dict(tree_flatten(model.parameters()))
    allowed = SANITIZED.get(model_type, ())
    changed = [
        k
        for k, v in written.items()
        if k not in allowed
        and (k not in loaded or loaded[k].shape != v.shape or not mx.array_equal(loaded[k], v))
    ]
    if changed:
        raise ValueError(f"sanitize() changed {len(changed)} written weights: {changed[:4]}")


def make_zoo_model(
    path: Path, model_type: str, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a tiny float32 random-weight ``model_type`` model into ``path`` (its tiny config
    with ``overrides`` merged in); returns it."""
    config = _merge(tiny_config(model_type), overrides or {})
    model_cls, args_cls = _model_class(model_type)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(copy.deepcopy(config)))
    init = _zoo_init(model, _vocab(config), seed)
    return tm._write_model(Path(path), config, seed, "float32", VOCAB, init=init)
