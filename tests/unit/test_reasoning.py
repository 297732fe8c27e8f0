"""Reasoning (<think>…</think>) split from content, whole and streamed."""

from __future__ import annotations

import random

import pytest

from tandem.server.reasoning import ReasoningSplitter, split_reasoning, starts_inside


def random_split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice((0, 1, 1, 2, 3, 5, 8))  # empty deltas too
        pieces.append(text[i : i + n])
        i += n
    return pieces


def stream(pieces: list[str], **kwargs) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    splitter = ReasoningSplitter(**kwargs)
    return [splitter.feed(p) for p in pieces], splitter.flush()


def streamed(pieces: list[str], **kwargs) -> tuple[str, str]:
    deltas, last = stream(pieces, **kwargs)
    deltas.append(last)
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def test_block_at_start_is_reasoning_and_blank_lines_after_it_are_dropped():
    assert split_reasoning("<think>\nLet me see.\n</think>\n\nThe answer is 4.") == (
        "\nLet me see.\n",
        "The answer is 4.",
    )


def test_leading_whitespace_before_the_block_is_allowed():
    assert split_reasoning(" \n<think>hmm</think>ok") == ("hmm", "ok")


def test_no_block_gives_none_and_the_text_untouched():
    assert split_reasoning("  Just an answer.\n") == (None, "  Just an answer.\n")


def test_think_later_in_the_text_is_content():
    text = "Answer first. <think>not reasoning</think> done"
    assert split_reasoning(text) == (None, text)


def test_only_the_first_block_counts():
    assert split_reasoning("<think>a</think>b<think>c</think>") == ("a", "b<think>c</think>")


def test_truncated_inside_reasoning_is_all_reasoning():
    assert split_reasoning("<think>still thinking about </thi") == (
        "still thinking about </thi",
        "",
    )


def test_empty_block_and_empty_output():
    assert split_reasoning("<think></think>\n\nHi") == ("", "Hi")
    assert split_reasoning("") == (None, "")
    assert split_reasoning("", inside=True) == ("", "")


def test_inside_means_generation_starts_in_the_block():
    assert split_reasoning("step 1\n</think>\n\nDone.", inside=True) == ("step 1\n", "Done.")
    assert split_reasoning("never closed", inside=True) == ("never closed", "")


def test_inside_with_a_second_start_tag_keeps_it_as_reasoning_text():
    assert split_reasoning("<think>x</think>y", inside=True) == ("<think>x", "y")


def test_output_that_is_only_part_of_a_start_tag_is_content():
    assert split_reasoning("<thi") == (None, "<thi")
    assert split_reasoning("<thinking>") == (None, "<thinking>")


def test_unicode_and_custom_tags():
    text = "[R]раздумье 🤔[/R]  ответ"
    assert split_reasoning(text, start="[R]", end="[/R]") == ("раздумье 🤔", "ответ")


def test_tags_split_over_deltas_never_leak():
    deltas, last = stream(["<", "thi", "nk>ab", "c</", "thi", "nk", ">\n", "\nHel", "lo"])
    assert deltas == [
        ("", ""),
        ("", ""),
        ("ab", ""),
        ("c", ""),
        ("", ""),
        ("", ""),
        ("", ""),
        ("", "Hel"),
        ("", "lo"),
    ]
    assert last == ("", "")


def test_held_text_is_released_once_it_cannot_be_a_tag():
    splitter = ReasoningSplitter()
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("e ") == ("", "<the ")
    assert splitter.feed("<think>") == ("", "<think>")  # no longer at the start


def test_partial_end_tag_inside_reasoning_is_released_as_reasoning():
    splitter = ReasoningSplitter(inside=True)
    assert splitter.feed("a </thi") == ("a ", "")
    assert splitter.feed("s") == ("</this", "")
    assert splitter.flush() == ("", "")


def test_one_delta_can_carry_reasoning_and_content():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>r</think>\nc") == ("r", "c")


def test_whitespace_after_end_tag_is_dropped_across_deltas():
    splitter = ReasoningSplitter(inside=True)
    assert [splitter.feed(p) for p in ["x</think>", " ", "\n", " y"]] == [
        ("x", ""),
        ("", ""),
        ("", ""),
        ("", "y"),
    ]


def test_flush_releases_held_content():
    splitter = ReasoningSplitter()
    assert splitter.feed("  <thin") == ("", "")
    assert splitter.flush() == ("", "  <thin")


def test_empty_tags_are_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningSplitter("", "</think>")


CORPUS = [
    "<think>\nThe user asks 2+2. That is 4.\n</think>\n\n2 + 2 = **4**.",
    "  <think>a < b and c </ d </thin k</think>\n\n\n  answer </think> <think>",
    "No reasoning here, <think>just text</think>.",
    "<think>truncated mid-thought </th",
    "<think></think>",
    "<<think>>",
    "<think>нет 思考 🙂</think>\t\n内容 ✓",
    "\n\n\n",
    "</think>leading end tag",
    "<thin",
    "<think>a</think>",
]


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("text", CORPUS)
def test_streaming_equals_whole_text_for_random_splits(text: str, inside: bool):
    reasoning, content = split_reasoning(text, inside=inside)
    rng = random.Random(f"{text}|{inside}")  # str seeds are stable across runs
    for _ in range(60):
        pieces = random_split(text, rng)
        assert "".join(pieces) == text
        assert streamed(pieces, inside=inside) == (reasoning or "", content)


def test_streamed_output_never_contains_a_tag():
    rng = random.Random(7)
    text = "<think>one two</think>\n\nthree"
    for _ in range(100):
        for r, c in stream(random_split(text, rng))[0]:
            assert "<" not in r + c and ">" not in r + c


def test_starts_inside():
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert starts_inside("...<｜Assistant｜><think>")
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_inside("<|im_start|>assistant\n")
    assert starts_inside("prompt [R] ", start="[R]")
