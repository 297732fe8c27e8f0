"""Build a Hugging Face fast tokenizer from the ``tokenizer.ggml.*`` metadata of a GGUF file.

Two vocabulary kinds: byte-level BPE (``tokenizer.ggml.model == "gpt2"``), whose
pre-tokenizer is picked from ``tokenizer.ggml.pre`` the way the original Hugging Face
``tokenizer.json`` of those model families defines it; and SentencePiece BPE (``"llama"``:
Gemma, Llama 2), tokenized as llama.cpp does: pieces merged by score with byte fallback.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as pre
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from tandem.frontend.gguf_meta import GGUFError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# llama.cpp's defaults for a SentencePiece ("llama") vocabulary, where the file is silent
_SPM_DEFAULTS: dict[str, Any] = {
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.unknown_token_id": 0,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.add_space_prefix": True,
}

_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Control tokens that end a turn even when they are not the declared eos (as llama.cpp does).
_END_OF_TURN_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}
)


def _split_then_bytes(regex: str) -> pre.PreTokenizer:
    return pre.Sequence(
        [
            pre.Split(Regex(regex), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _pre_tokenizer(kind: str, path: str) -> tuple[pre.PreTokenizer, bool]:
    """The pre-tokenizer for ``tokenizer.ggml.pre`` == kind, and BPE's ``ignore_merges``."""
    if kind in ("default", "gpt2"):
        return pre.ByteLevel(add_prefix_space=False, use_regex=True), False
    if kind == "smollm":
        digits = pre.Digits(individual_digits=True)
        return pre.Sequence([digits, pre.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    if kind == "qwen2":
        return _split_then_bytes(_QWEN2_REGEX), False
    if kind == "llama-bpe":
        return _split_then_bytes(_LLAMA3_REGEX), True
    raise GGUFError(
        f"{path}: unsupported tokenizer pre-tokenizer tokenizer.ggml.pre={kind!r} "
        "(supported: default, gpt2, smollm, qwen2, llama-bpe)"
    )


def _token_id(meta: dict[str, Any], key: str, n_tokens: int, path: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n_tokens:
        raise GGUFError(f"{path}: tokenizer.ggml.{key}={value!r} is not a token id")
    return value


def eos_token_ids(meta: dict[str, Any]) -> set[int]:
    """Ids that end generation: eos, eot and eom ids, plus end-of-turn control tokens."""
    if meta.get("tokenizer.ggml.model") == "llama":
        meta = {**_SPM_DEFAULTS, **meta}
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    ids = {
        meta[f"tokenizer.ggml.{key}"]
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int)
    }
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind == TOKEN_CONTROL and text in _END_OF_TURN_TEXTS:
            ids.add(i)
    return ids


def _byte_level_bpe(meta: dict[str, Any], vocab: dict[str, int], name: str) -> Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise GGUFError(f"{name}: tokenizer.ggml.tokens / tokenizer.ggml.merges missing")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFError(f"{name}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))

    pre_tokenizer, ignore_merges = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), name)
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=ignore_merges))
    if meta.get("tokenizer.ggml.pre") == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(
    meta: dict[str, Any], tokens: list[str], vocab: dict[str, int], name: str
) -> Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a BPE: it starts from characters and merges the
    adjacent pair whose concatenation is a token of the highest score (the leftmost of
    equals), then falls back to ``<0xXX>`` byte tokens for characters not in the vocabulary.
    As BPE merges that is every split of a token into two tokens, ranked by its score. The
    text gets no pre-tokenizer; spaces become "▁", with one in front of the text and after
    each special token when ``tokenizer.ggml.add_space_prefix`` (Gemma: false)."""
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise GGUFError(f"{name}: tokenizer.ggml.scores missing or not one per token")
    ranked: list[tuple[float, int, int, str, str]] = []
    for text, i in vocab.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort(key=lambda r: r[:3])
    unk = _token_id(meta, "unknown_token_id", len(tokens), name)
    tok = Tokenizer(
        models.BPE(
            vocab,
            [(left, right) for *_, left, right in ranked],
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback="<0x00>" in vocab,
        )
    )
    prefix = bool(meta["tokenizer.ggml.add_space_prefix"])
    escape = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if prefix else escape
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def tokenizer_from_gguf(
    meta: dict[str, Any], path: str | os.PathLike[str]
) -> PreTrainedTokenizerFast:
    """A fast tokenizer equivalent to the one the GGUF metadata ``meta`` describes.

    ``path`` only names the file in error messages.
    """
    name = os.fspath(path)
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise GGUFError(
            f"{name}: unsupported tokenizer model tokenizer.ggml.model={model!r} "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
        )
    if model == "llama":
        meta = {**_SPM_DEFAULTS, **meta}
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise GGUFError(f"{name}: tokenizer.ggml.tokens missing")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{name}: {len(types)} token types for {len(tokens)} tokens")

    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)  # a duplicate string keeps its first id
    if model == "gpt2":
        tok = _byte_level_bpe(meta, vocab, name)
    else:
        tok = _sentencepiece_bpe(meta, tokens, vocab, name)

    # Control tokens are special; user-defined ones are matched whole but kept on decode.
    tok.add_special_tokens(
        [
            AddedToken(text, normalized=False, special=True)
            for text, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(text, normalized=False, special=False)
            for text, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_USER_DEFINED
        ]
    )

    keys = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    ids = {k: _token_id(meta, f"{g}_token_id", len(tokens), name) for k, g in keys.items()}
    specials = {f"{k}_token": tokens[i] for k, i in ids.items() if i is not None}

    wrap: dict[str, tuple[str, int]] = {}
    for key, setting in (("bos", "add_bos_token"), ("eos", "add_eos_token")):
        token_id = ids[key]
        if meta.get(f"tokenizer.ggml.{setting}", False) and token_id is not None:
            wrap[key] = (tokens[token_id], token_id)
    if wrap:
        head = [wrap["bos"][0]] if "bos" in wrap else []
        tail = [wrap["eos"][0]] if "eos" in wrap else []
        tok.post_processor = TemplateProcessing(
            single=[*head, "$A", *tail],
            pair=[*head, "$A", *tail, *head, "$B:1", *tail],
            special_tokens=list(set(wrap.values())),
        )

    arch = meta.get("general.architecture")
    context = meta.get(f"{arch}.context_length")
    templates = {
        key.removeprefix("tokenizer.chat_template."): value
        for key, value in meta.items()
        if key.startswith("tokenizer.chat_template.") and isinstance(value, str)
    }
    template: str | dict[str, str] | None = meta.get("tokenizer.chat_template")
    if templates:
        template = {**({"default": template} if template else {}), **templates}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=template,
        model_max_length=context if isinstance(context, int) else int(1e30),
        clean_up_tokenization_spaces=False,
        **specials,
    )
