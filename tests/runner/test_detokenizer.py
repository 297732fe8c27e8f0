"""IncrementalDetokenizer: tokenizers' DecodeStream where it applies, the same text as the
decode-twice method it replaced, on a byte-level BPE and on a byte-fallback tokenizer."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from tandem.testing.byte_fallback import use_byte_fallback_tokenizer

PROPERTY = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer(request, tiny_model_dir, tmp_path_factory) -> Tokenizer:
    path = tiny_model_dir("llama")
    if request.param == "byte_fallback":
        path = use_byte_fallback_tokenizer(
            shutil.copytree(path, tmp_path_factory.mktemp("bf") / "model")
        )
    return Tokenizer.load(path)


def decode_twice(
    tok: Tokenizer, prompt: list[int], chunks: list[list[int]], skip: bool
) -> list[str]:
    """The detokenizer before DecodeStream (its deltas), frozen here as the reference."""
    ids = list(prompt[-4:])
    prefix_offset, read_offset = 0, len(ids)
    out = []
    for chunk in chunks:
        ids.extend(chunk)
        prefix = tok.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip)
        full = tok.decode(ids[prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            prefix_offset, read_offset = read_offset, len(ids)
            out.append(full[len(prefix) :])
        else:
            out.append("")
    return out


def streamed(tok: Tokenizer, prompt: list[int], chunks: list[list[int]], skip: bool) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [d.add(c) for c in chunks]


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    for n in sizes or [1]:
        if i >= len(ids):
            break
        chunks.append(ids[i : i + n])
        i += n
    while i < len(ids):
        chunks.append(ids[i : i + 1])
        i += 1
    return chunks


SPECIAL_IDS = (0, 1, 2)  # <|endoftext|>, <|im_start|>, <|im_end|>
TEXT = st.text(
    alphabet=st.sampled_from("the fox ran\n.,!?0123 éü—“”☃日本🙂\t"), max_size=40
) | st.text(max_size=20)


@PROPERTY
@given(
    pieces=st.lists(st.tuples(TEXT, st.sampled_from(SPECIAL_IDS)), min_size=1, max_size=4),
    sizes=st.lists(st.integers(1, 4), max_size=30),
    skip=st.booleans(),
)
def test_streamed_text_equals_the_full_decode(tokenizer, pieces, sizes, skip):
    """Random text (byte-fallback and multi-byte characters included) with special tokens
    between its characters, fed in random chunks: the deltas add up to ``decode(all)``."""
    ids = []
    for text, special in pieces:
        ids += [*tokenizer.encode(text, add_special_tokens=False), special]
    ids.pop()  # the text may end inside a word, never inside a character
    d = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    out = "".join(d.add(c) for c in split(ids, sizes)) + d.finish()
    assert out == tokenizer.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_any_token_sequence_gives_the_same_deltas_as_before(tokenizer, data, skip):
    """Arbitrary ids (ill-formed byte runs, lone continuation bytes, specials), a random
    prompt as context, random chunks (empty ones too): delta for delta the old method's."""
    ids = st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40)
    prompt = data.draw(ids.map(lambda p: p[:8]))
    chunks = split(data.draw(ids), data.draw(st.lists(st.integers(0, 4), max_size=30)))
    assert streamed(tokenizer, prompt, chunks, skip) == decode_twice(
        tokenizer, prompt, chunks, skip
    )


@pytest.mark.parametrize("text", ["ok \ufffd", "\ufffd", "a ☃"])
def test_what_is_held_back_comes_out_at_the_end(tokenizer, text):
    """A replacement character the output really ends with (found by the property test
    above), or a character it stopped inside: the finished stream says what a full decode
    says, where ``add`` alone held it back."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if text == "a ☃":
        ids = ids[:-1]  # stopped inside the snowman's bytes
    d = IncrementalDetokenizer(tokenizer)
    held = "".join(d.add([t]) for t in ids)
    assert held + d.finish() == tokenizer.decode(ids)
    assert tokenizer.decode(ids).endswith("\ufffd") and not held.endswith("\ufffd")
    assert d.finish() == ""  # (nothing is held after the end)


def test_a_character_split_across_tokens_comes_out_whole(tokenizer):
    ids = tokenizer.encode("a ☃ b", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add([t]) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "☃" in deltas[[i for i, s in enumerate(deltas) if "☃" in s][0]]
    assert all("\ufffd" not in s for s in deltas)


def test_special_tokens_are_skipped_or_kept_and_an_empty_add_is_nothing(tokenizer):
    hello = tokenizer.encode("hello", add_special_tokens=False)
    for skip, eos in ((True, ""), (False, "<|im_end|>")):
        d = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        assert "".join(d.add([t]) for t in hello) + d.add([2]) + d.add([]) == "hello" + eos


def test_the_prompt_gives_the_leading_space_context(tokenizer):
    prompt = tokenizer.encode("The fox", add_special_tokens=False)
    out = tokenizer.encode(" ran to the river", add_special_tokens=False)
    want = tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt)) :]
    assert "".join(streamed(tokenizer, prompt, [[t] for t in out], True)) == want


def test_a_prompt_ending_inside_a_character_keeps_its_end_out_of_the_text(tokenizer):
    snowman = tokenizer.encode("a☃", add_special_tokens=False)[-3:]
    assert tokenizer.decode(snowman) == "☃"  # its three UTF-8 bytes, one token each
    prompt = tokenizer.encode("a", add_special_tokens=False) + snowman[:1]
    chunks = [snowman[1:2], snowman[2:], tokenizer.encode("hi", add_special_tokens=False)]
    got = streamed(tokenizer, prompt, chunks, True)
    assert got == decode_twice(tokenizer, prompt, chunks, True) and "☃" not in "".join(got)


def test_a_fast_tokenizer_streams_without_decoding_in_python(tokenizer, monkeypatch):
    """DecodeStream does the work: no ``Tokenizer.decode`` per token (the old method made
    two, each re-decoding the window), one at most to check the prompt context."""
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or decode(*a, **k))
    ids = tokenizer.encode("The fox ran to the river, café ☃ 🙂. " * 4, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, ids[:5])
    out = "".join(d.add([t]) for t in ids[5:])
    assert len(calls) <= 1
    assert out == decode(ids)[len(decode(ids[:5])) :]
