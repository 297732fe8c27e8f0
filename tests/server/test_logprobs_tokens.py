"""Log-probability token strings over HTTP on a byte-fallback tokenizer: unique per position
(``bytes:\\xNN`` for part of a character), the chosen token always in its completions top,
and chat ``bytes`` that are each token's own bytes."""

from __future__ import annotations

import json
import re

import pytest

from tandem.frontend.tokenizer import Tokenizer
from tandem.testing.byte_fallback import make_byte_fallback_model
from tandem.testing.live_server import Server

PROMPT = "café ☃ the fox"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_byte_fallback_model(tmp_path_factory.mktemp("bf") / "llama", "llama")


@pytest.fixture(scope="module")
def server(model):
    s = Server(model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.load(model)


def real_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """What the token stands for, read off its vocabulary piece (the test's own oracle)."""
    piece = tokenizer.hf.convert_ids_to_tokens(token_id)
    if m := re.fullmatch(r"<0x([0-9A-F]{2})>", piece):
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode()


def shown_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode()


def completion(server: Server, **body) -> dict:
    r = server.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_completions_top_logprobs_keep_all_alternatives_and_the_chosen_one(server, tokenizer):
    choice = completion(server, max_tokens=24, temperature=0, logprobs=5, return_token_ids=True)
    lp, ids = choice["logprobs"], choice["token_ids"]
    assert len(lp["tokens"]) == len(ids) == 24
    # Byte tokens decode alone to U+FFFD (and <0x0A> to the "\n" piece's text): before, they
    # overwrote each other and fewer than 5 alternatives came back.
    assert all(len(top) == 5 for top in lp["top_logprobs"]), lp["top_logprobs"]
    for token, v, top, t in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], ids, strict=True
    ):
        assert top[token] == v  # greedy: the chosen token is in the top 5, with its logprob
        assert shown_bytes(token) == real_bytes(tokenizer, t)
        assert "\ufffd" not in "".join(top)
    assert sum(k.startswith("bytes:") for top in lp["top_logprobs"] for k in top) >= 10
    assert any(t.startswith("bytes:") for t in lp["tokens"])


def test_a_sampled_token_outside_the_top_k_is_added_to_it(server):
    choice = completion(server, max_tokens=32, temperature=1.0, seed=3, logprobs=1)
    lp = choice["logprobs"]
    sizes = [len(top) for top in lp["top_logprobs"]]
    assert set(sizes) <= {1, 2} and 2 in sizes  # k + 1 where the sample was not the best
    for token, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[token] == v
        assert len(top) == 1 or v <= min(top.values())


def test_echoed_prompt_tokens_show_their_bytes_and_offsets_follow_the_text(server):
    choice = completion(server, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp, text = choice["logprobs"], choice["text"]
    prompt = lp["tokens"][:-1]
    assert b"".join(shown_bytes(t) for t in prompt).decode().strip() == PROMPT
    assert "bytes:\\xc3" in prompt and "bytes:\\xe2" in prompt  # é and ☃ as byte tokens
    assert lp["top_logprobs"][0] is None
    assert all(
        top[t] == v
        for t, v, top in zip(
            prompt[1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=False
        )
    )
    offsets = lp["text_offset"]
    assert text[: len(PROMPT)] == PROMPT and offsets == sorted(offsets) and offsets[0] == 0
    # A character's bytes all start where the character does; a word piece starts at its text
    # (the first one's leading space is not in the text).
    assert text.startswith(prompt[0].lstrip())
    for t, off in zip(prompt[1:], offsets[1:], strict=False):
        if t.startswith("bytes:"):
            assert text[off] in "é☃"
        else:
            assert text[off : off + len(t)] == t


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_show_each_tokens_own_bytes(server, tokenizer, stream):
    body = {
        "messages": [{"role": "user", "content": "café ☃"}],
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        content = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
        ids = [t for c in choices for t in c.get("token_ids") or []]
    else:
        choice = r.json()["choices"][0]
        content, ids = choice["logprobs"]["content"], choice["token_ids"]
    assert len(content) == len(ids) == 16
    for entry, t in zip(content, ids, strict=True):
        assert bytes(entry["bytes"]) == real_bytes(tokenizer, t) == shown_bytes(entry["token"])
        tops = entry["top_logprobs"]
        assert len({e["token"] for e in tops}) == len(tops) == 5
        assert all(bytes(e["bytes"]) == shown_bytes(e["token"]) for e in tops)
    assert any(len(entry["bytes"]) == 1 and entry["bytes"][0] >= 0x80 for entry in content)
