"""Fill-in-the-middle prompts: the code before the cursor (prefix) and after it (suffix) laid
out with the model's own FIM tokens, so that the model writes the middle.

A family is recognised by its marker tokens being in the vocabulary (one token each); the
prompt is, in order:

- qwen (Qwen2.5-Coder; CodeGemma spells them the same): ``<|fim_prefix|>`` prefix
  ``<|fim_suffix|>`` suffix ``<|fim_middle|>``
- starcoder (StarCoder, StarCoder2): ``<fim_prefix>`` prefix ``<fim_suffix>`` suffix
  ``<fim_middle>``
- deepseek (DeepSeek-Coder): ``<｜fim▁begin｜>`` prefix ``<｜fim▁hole｜>`` suffix
  ``<｜fim▁end｜>``
- codellama: ``▁<PRE>`` prefix ``▁<SUF>`` suffix ``▁<MID>`` (or spelled without ``▁``); the
  middle ends at ``<EOT>``, a stop token besides EOS
- mistral (Codestral; suffix first, no middle marker): ``[SUFFIX]`` suffix ``[PREFIX]`` prefix

Texts are encoded as text (special-token strings inside them stay text). The prompt starts
with BOS exactly when the tokenizer puts one before a plain prompt (DeepSeek-Coder, CodeLlama,
Codestral, CodeGemma; not Qwen or StarCoder). With a SentencePiece-style tokenizer (one that
prepends a space to every text) the prefix keeps that space and the suffix does not: Meta's
CodeLlama writes ``<PRE> {prefix} <SUF>{suffix} <MID>``, mistral-common
``[SUFFIX]suffix[PREFIX] prefix``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.frontend.tokenizer import Tokenizer


class Slot(enum.Enum):
    PREFIX = "prefix"
    SUFFIX = "suffix"


P, S = Slot.PREFIX, Slot.SUFFIX
# (family, layout with marker spellings, tokens that end the middle besides EOS)
_FAMILIES: tuple[tuple[str, tuple[str | Slot, ...], tuple[str, ...]], ...] = (
    ("qwen", ("<|fim_prefix|>", P, "<|fim_suffix|>", S, "<|fim_middle|>"), ()),
    ("starcoder", ("<fim_prefix>", P, "<fim_suffix>", S, "<fim_middle>"), ()),
    ("deepseek", ("<｜fim▁begin｜>", P, "<｜fim▁hole｜>", S, "<｜fim▁end｜>"), ()),
    ("codellama", ("▁<PRE>", P, "▁<SUF>", S, "▁<MID>"), ("▁<EOT>",)),
    ("codellama", ("<PRE>", P, "<SUF>", S, "<MID>"), ("<EOT>",)),
    ("mistral", ("[SUFFIX]", S, "[PREFIX]", P), ()),
)
_ANCHOR = "\n"  # a SentencePiece byte-fallback piece: merges with nothing after it


@dataclass(frozen=True)
class FimSpec:
    """How one tokenizer lays out a FIM prompt: marker ids and text slots in prompt order."""

    family: str
    layout: tuple[int | Slot, ...]
    bos_id: int | None  # first, when the tokenizer starts plain prompts with it
    spaced: bool  # the tokenizer prepends a space to a text (SentencePiece's dummy prefix)
    stop_ids: tuple[int, ...] = ()  # end the middle (CodeLlama's <EOT>), besides EOS


def fim_tokens(tokenizer: Tokenizer) -> FimSpec | None:
    """The FIM layout of the first family whose markers are all in the vocabulary (and the
    stop tokens of it that are there too), or None."""
    vocab = tokenizer.hf.get_vocab()
    for family, layout, stops in _FAMILIES:
        markers = [p for p in layout if isinstance(p, str)]
        if not all(m in vocab for m in markers):
            continue
        return FimSpec(
            family=family,
            layout=tuple(p if isinstance(p, Slot) else vocab[p] for p in layout),
            bos_id=_bos_id(tokenizer),
            spaced=_spaced(tokenizer),
            stop_ids=tuple(vocab[s] for s in stops if s in vocab),
        )
    return None


def fim_prompt(spec: FimSpec, tokenizer: Tokenizer, prefix: str, suffix: str) -> list[int]:
    """The prompt's token ids. Raises ValueError if the suffix cannot be encoded without the
    tokenizer's leading space."""
    ids = [] if spec.bos_id is None else [spec.bos_id]
    for part in spec.layout:
        if part is Slot.PREFIX:
            ids += _text_ids(tokenizer, prefix)
        elif part is Slot.SUFFIX:
            ids += _unspaced_ids(tokenizer, suffix) if spec.spaced else _text_ids(tokenizer, suffix)
        else:
            ids.append(part)
    return ids


def _text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.hf.encode(text, add_special_tokens=False, split_special_tokens=True))


def _unspaced_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` without the space a SentencePiece tokenizer puts before it: encoded after an
    anchor whose own tokens are then dropped (Meta and Mistral do the same with "☺")."""
    if not text:
        return []
    anchor = _text_ids(tokenizer, _ANCHOR)
    ids = _text_ids(tokenizer, _ANCHOR + text)
    if ids[: len(anchor)] != anchor:
        raise ValueError("the suffix cannot be encoded without a leading space")
    return ids[len(anchor) :]


def _bos_id(tokenizer: Tokenizer) -> int | None:
    bos = tokenizer.hf.bos_token_id
    with_special = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    starts = bos is not None and with_special[:1] == [bos] and plain[:1] != [bos]
    return bos if starts else None


def _spaced(tokenizer: Tokenizer) -> bool:
    pieces = tokenizer.hf.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))
    return bool(pieces) and pieces[0].startswith("▁")
