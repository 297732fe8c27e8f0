"""The bytes each token id stands for, read from the tokenizer's vocabulary and decoder.

Decoding one token alone loses them for a token that holds part of a character: a
byte-fallback ``<0xE2>`` or a byte-level piece of a multi-byte character decodes to U+FFFD,
so different tokens look the same. A SentencePiece word piece (``▁the``) loses its leading
space. Here the piece itself is read: ``<0xNN>`` is one byte (byte fallback), a byte-level
piece maps back through the GPT-2 byte alphabet, and ``▁`` is a space where the decoder says
so. Added tokens are their text. Any other tokenizer falls back to the lone decoding. No mlx.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.frontend.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> byte.
    Printable Latin-1 bytes stand for themselves; the others take code points from 256 up."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return {c: b for b, c in chars.items()}


@dataclass(frozen=True)
class PieceRules:
    """How the decoder turns a vocabulary piece into bytes (the parts of it that act on one
    piece; whole-sequence steps such as Strip are left out on purpose)."""

    byte_level: bool = False
    byte_fallback: bool = False
    replacements: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, decoder: dict[str, Any] | None) -> PieceRules | None:
        """From a tokenizer.json ``decoder``; None when some step is not understood."""
        steps = [] if decoder is None else [decoder]
        if decoder is not None and decoder["type"] == "Sequence":
            steps = decoder["decoders"]
        byte_level = byte_fallback = False
        replacements: list[tuple[str, str]] = []
        for step in steps:
            kind = step["type"]
            if kind == "ByteLevel":
                byte_level = True
            elif kind == "ByteFallback":
                byte_fallback = True
            elif kind == "Replace" and "String" in step["pattern"]:
                replacements.append((step["pattern"]["String"], step["content"]))
            elif kind == "Metaspace":
                replacements.append((step["replacement"], " "))
            elif kind not in ("Fuse", "Strip"):
                return None  # WordPiece, CTC, regex replacements...
        return cls(byte_level, byte_fallback, tuple(replacements))

    def piece_bytes(self, piece: str) -> bytes:
        if self.byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        for old, new in self.replacements:
            piece = piece.replace(old, new)
        if self.byte_level:
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return piece.encode()


class TokenBytes:
    """token id -> its bytes (cached), and which ids are special tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from transformers import PreTrainedTokenizerFast

        hf = tokenizer.hf
        self._tokenizer = tokenizer
        added = hf.added_tokens_decoder
        self._added = {i: t.content.encode() for i, t in added.items()}
        self.special = frozenset(i for i, t in added.items() if t.special)
        self._backend = hf.backend_tokenizer if isinstance(hf, PreTrainedTokenizerFast) else None
        self._rules = None
        if self._backend is not None:
            self._rules = PieceRules.of(json.loads(self._backend.to_str())["decoder"])
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id]
        if self._rules is None or self._backend is None:
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        piece = self._backend.id_to_token(token_id)
        return b"" if piece is None else self._rules.piece_bytes(piece)


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer: Tokenizer) -> TokenBytes:
    """One TokenBytes per tokenizer (reading the decoder serializes the whole tokenizer)."""
    return TokenBytes(tokenizer)
