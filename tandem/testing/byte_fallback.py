"""A SentencePiece-style tokenizer with byte fallback for the tiny models (never downloaded).

``use_byte_fallback_tokenizer(model_dir)`` replaces the byte-level BPE ``tokenizer.json`` that
``make_tiny_model`` writes with one laid out like Llama 2's: words marked by ``▁``, a BPE
trained on the tiny-model corpus, and the 256 tokens ``<0x00>`` .. ``<0xFF>`` for every byte
the vocabulary has no piece for, so any character outside the corpus (``é``, ``☃``, ``🙂``)
is spelled as its UTF-8 bytes. The added (special) tokens keep their ids and the vocabulary
its size, so the model's config, EOS ids and chat template stay valid.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.testing.tiny_models import CORPUS, make_tiny_model

NUM_BYTE_TOKENS = 256


def byte_token(b: int) -> str:
    return f"<0x{b:02X}>"


def byte_fallback_tokenizer_json(added: dict[int, str], total_vocab: int) -> str:
    """Added tokens at their ids, then the byte tokens, then trained pieces and never-produced
    filler pieces up to exactly ``total_vocab`` ids."""
    if sorted(added) != list(range(len(added))):
        raise ValueError("the added tokens must hold the first ids")
    num_trained = total_vocab - NUM_BYTE_TOKENS
    if num_trained <= len(added):
        raise ValueError(f"a vocabulary of {total_vocab} leaves no room for trained pieces")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=num_trained, special_tokens=[added[i] for i in sorted(added)]
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    data = json.loads(tok.to_str())
    trained = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
    pieces = [t for t in trained if t not in added.values()]
    vocab = {added[i]: i for i in sorted(added)}
    for b in range(NUM_BYTE_TOKENS):
        vocab[byte_token(b)] = len(vocab)
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    fill = ("".join(p) for r in itertools.count(2) for p in itertools.product(pieces, repeat=r))
    while len(vocab) < total_vocab:
        vocab.setdefault(next(fill), len(vocab))
    data["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True, unk_token=None)
    out = Tokenizer.from_str(json.dumps(data))
    out.decoder = llama2_decoder()
    return out.to_str()


def llama2_decoder() -> decoders.Decoder:
    """Llama 2's decoder: ▁ is a space, byte tokens join into characters, the leading space
    goes."""
    return decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )


def use_byte_fallback_tokenizer(model_dir: Path) -> Path:
    """Rewrite ``model_dir``'s tokenizer.json as a byte-fallback one; returns ``model_dir``."""
    path = Path(model_dir) / "tokenizer.json"
    old = json.loads(path.read_text(encoding="utf-8"))
    added = {t["id"]: t["content"] for t in old["added_tokens"]}
    text = byte_fallback_tokenizer_json(added, len(old["model"]["vocab"]))
    path.write_text(text, encoding="utf-8")
    return Path(model_dir)


def make_byte_fallback_model(path: Path, arch: str, **kwargs: Any) -> Path:
    """``make_tiny_model(path, arch, **kwargs)`` with a byte-fallback tokenizer."""
    return use_byte_fallback_tokenizer(make_tiny_model(path, arch, **kwargs))
