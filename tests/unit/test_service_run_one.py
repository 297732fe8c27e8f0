"""``Service.run_one`` over a fake engine client: the text of a finished output is the decode
of its tokens, the tail the streaming detokenizer held back (text ending in U+FFFD)
included, with stop tokens and stop strings as before."""

from __future__ import annotations

import asyncio

import pytest

from tandem.frontend.engine_client import Delta
from tandem.frontend.tokenizer import Tokenizer
from tandem.sampling_params import SamplingParams
from tandem.server.service import ServerSettings, Service


class FakeClient:
    """Replays ``deltas`` for every request."""

    dead = None
    info = {"max_model_len": 4096, "model_type": "llama"}

    def __init__(self, deltas: list[Delta]) -> None:
        self.deltas = deltas

    async def generate(self, rid, prompt_ids, params, follows=None):
        for d in self.deltas:
            yield d


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir("llama"))


def run(tok: Tokenizer, deltas: list[Delta], stops: list[str] = ()) -> list:
    service = Service(FakeClient(deltas), tok, ServerSettings("tiny"))
    params = SamplingParams(max_tokens=64)

    async def pieces() -> list:
        return [p async for p in service.run_one([], params, list(stops))]

    return asyncio.run(pieces())


def cut_snowman(tok: Tokenizer) -> list[int]:
    """Tokens of "a ☃" cut inside the snowman's bytes (the text ends in U+FFFD)."""
    ids = tok.encode("a ☃", add_special_tokens=False)[:-1]
    assert tok.decode(ids).endswith("\ufffd")
    return ids


@pytest.mark.parametrize("split", [1, 2, 100])
def test_a_length_finish_keeps_the_cut_character(tok, split) -> None:
    ids = cut_snowman(tok)
    chunks = [ids[i : i + split] for i in range(0, len(ids), split)]
    deltas = [Delta(c, None) for c in chunks[:-1]] + [Delta(chunks[-1], "length")]
    pieces = run(tok, deltas)
    assert "".join(p.text for p in pieces) == tok.decode(ids)
    assert pieces[-1].finish_reason == "length"
    assert [t for p in pieces for t in p.token_ids] == ids


@pytest.mark.parametrize("alone", [False, True])
def test_a_stop_token_still_flushes_the_held_text(tok, alone) -> None:
    """The stop token itself is not text; what came before it all is (the token may come in
    the same delta as the text or alone in the last)."""
    ids = cut_snowman(tok)
    eos = min(tok.eos_token_ids)
    deltas = [Delta(ids, None), Delta([eos], "stop")] if alone else [Delta([*ids, eos], "stop")]
    pieces = run(tok, deltas)
    assert "".join(p.text for p in pieces) == tok.decode(ids)
    assert pieces[-1].finish_reason == "stop"


def test_a_stop_string_in_the_held_tail_ends_the_output_there(tok) -> None:
    ids = cut_snowman(tok)
    text = tok.decode(ids)
    pieces = run(tok, [Delta(ids, "length")], stops=["\ufffd"])
    assert pieces[-1].finish_reason == "stop" and pieces[-1].stop_sequence == "\ufffd"
    assert "".join(p.text for p in pieces) == text[: text.index("\ufffd")]


def test_a_stop_string_inside_a_delta_is_unchanged(tok) -> None:
    """A stop string that completes inside a multi-token delta (speculation) ends the output
    at that token, nothing after it reported, as before the flush existed."""
    ids = tok.encode("the fox ran to the river", add_special_tokens=False)
    pieces = run(tok, [Delta(ids, "length")], stops=["ran"])
    assert pieces[-1].finish_reason == "stop" and pieces[-1].stop_sequence == "ran"
    assert "".join(p.text for p in pieces) == "the fox "
    assert len(pieces[-1].token_ids) < len(ids)
