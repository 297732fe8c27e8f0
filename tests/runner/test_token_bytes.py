"""Token bytes read off the vocabulary, and log-probability token strings unique per position."""

from __future__ import annotations

import shutil

import pytest
from tokenizers import pre_tokenizers

from tandem.frontend.token_bytes import byte_level_alphabet, token_bytes
from tandem.frontend.tokenizer import Tokenizer
from tandem.server.logprobs_format import LogprobsFormatter
from tandem.testing.byte_fallback import byte_token, use_byte_fallback_tokenizer

TEXT = "The fox ran to the café ☃ 🙂 “quoted”\n\tend"


@pytest.fixture(scope="module")
def byte_level(tiny_model_dir) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def byte_fallback(tiny_model_dir, tmp_path_factory) -> Tokenizer:
    copy = shutil.copytree(tiny_model_dir("llama"), tmp_path_factory.mktemp("bf") / "model")
    return Tokenizer.load(use_byte_fallback_tokenizer(copy))


def test_the_byte_level_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == 0x41 and alphabet["Ġ"] == 0x20


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_token_bytes_add_up_to_the_text(request, kind):
    tok: Tokenizer = request.getfixturevalue(kind)
    ids = tok.encode(TEXT, add_special_tokens=False)
    joined = b"".join(token_bytes(tok)(t) for t in ids)
    # SentencePiece marks the first word with ▁ too (decode strips that space).
    assert joined == (b" " if kind == "byte_fallback" else b"") + TEXT.encode()
    assert token_bytes(tok)(2) == b"<|im_end|>" and 2 in token_bytes(tok).special


def test_strings_are_unique_at_a_position_and_the_chosen_token_keeps_its_text(byte_fallback):
    vocab = byte_fallback.hf.get_vocab()
    newline, e2, e3 = vocab["\n"], vocab[byte_token(0xE2)], vocab[byte_token(0xE3)]
    byte_newline = vocab[byte_token(0x0A)]  # decodes alone to "\n" as well
    fmt = LogprobsFormatter(byte_fallback)
    names = fmt.strings(byte_newline, [(e2, -1.0), (newline, -2.0), (e3, -3.0), (byte_newline, -4)])
    assert names == {
        byte_newline: "\n",
        e2: "bytes:\\xe2",
        newline: "bytes:\\x0a",
        e3: "bytes:\\xe3",
    }
    assert fmt.strings(newline, [(byte_newline, -1.0)]) == {
        newline: "\n",
        byte_newline: "bytes:\\x0a",
    }


def test_completions_top_logprobs_hold_k_plus_one_when_the_chosen_token_is_not_in_the_top(
    byte_fallback,
):
    vocab = byte_fallback.hf.get_vocab()
    e2, e3, fox = vocab[byte_token(0xE2)], vocab[byte_token(0xE3)], vocab["▁fo"]
    out, end = LogprobsFormatter(byte_fallback).completion(
        0, [(fox, (-5.0, [(e2, -1.0), (e3, -2.0)]))], 7, context=[]
    )
    assert out["tokens"] == [" fo"] and out["token_logprobs"] == [-5.0]
    assert out["top_logprobs"] == [{"bytes:\\xe2": -1.0, "bytes:\\xe3": -2.0, " fo": -5.0}]
    assert out["text_offset"] == [7] and end == 7 + len("fo")  # the first word's space goes
