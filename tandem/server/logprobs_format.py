"""OpenAI's log-probability shapes (completions, chat and the ``prompt_logprobs`` extension)
from the engine's entries: per token, (its log-probability, its position's top (id,
log-probability) pairs, best first).

Each token is shown by a string that is unique among the tokens of its position, so that a
completions ``top_logprobs`` dict keeps every alternative: the token's text when its bytes
are a whole UTF-8 text, else (part of a character, as a byte-fallback ``<0xE2>`` is, or
text that another token there already shows) its bytes as ``bytes:\\xe2\\x80`` (vLLM's
spelling), else ``token_id:N``. The chosen token takes its string first, so it does not
depend on the alternatives, and it is always in its position's completions
``top_logprobs`` with its own log-probability (k + 1 entries when it is not in the top k,
as OpenAI returns them). Chat ``bytes`` are the token's own bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tandem.frontend.token_bytes import TokenBytes, token_bytes
from tandem.frontend.tokenizer import IncrementalDetokenizer, Tokenizer

TopPairs = Sequence[Sequence[Any]]  # (token id, log-probability) pairs
Entry = Sequence[Any]  # (log-probability, TopPairs)


def bytes_string(b: bytes) -> str:
    return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def as_text(b: bytes) -> str | None:
    """``b`` as text, if it is whole UTF-8 (and not a replacement character's stand-in)."""
    try:
        text = b.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\ufffd" in text else text


class LogprobsFormatter:
    """One request's formatter (it holds each completions choice's text offset state)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._detoks: dict[int, IncrementalDetokenizer] = {}

    @functools.cached_property
    def bytes(self) -> TokenBytes:
        return token_bytes(self._tokenizer)  # built on first use (requests without logprobs)

    def strings(self, chosen: int, top: TopPairs = ()) -> dict[int, str]:
        """The string of each token at one position (the chosen one and the top ones)."""
        out: dict[int, str] = {}
        used: set[str] = set()
        for t in (chosen, *(a for a, _ in top)):
            if t in out:
                continue
            b = self.bytes(t)
            s = as_text(b)
            if s is None or s in used:
                s = bytes_string(b)
            if s in used:
                s = f"token_id:{t}"
            used.add(s)
            out[t] = s
        return out

    def completion(
        self,
        choice: int,
        pairs: Sequence[tuple[int, Entry | None]],
        text_offset: int,
        context: Sequence[int],
    ) -> tuple[dict[str, Any], int]:
        """Completions' logprobs of a choice's next (token id, entry or None) pairs, the first
        at ``text_offset`` characters into its text; also the offset after them. A token's
        offset is where the text stood before it, from the choice's own detokenizer (begun
        on ``context``, the prompt ids, or none when the pairs start with the echoed prompt),
        so it counts what the token adds to the text, not its string."""
        detok = self._detoks.get(choice)
        if detok is None:
            detok = self._detoks[choice] = IncrementalDetokenizer(self._tokenizer, list(context))
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for t, e in pairs:
            offsets.append(text_offset)
            text_offset += len(detok.add([t]))
            if e is None:
                tokens.append(self.strings(t)[t])
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            lp, top = e
            names = self.strings(t, top)
            tokens.append(names[t])
            token_logprobs.append(lp)
            entries = {names[a]: v for a, v in top}
            entries[names[t]] = lp
            top_logprobs.append(entries)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }, text_offset

    def chat(self, ids: Sequence[int], lps: Sequence[Entry]) -> dict[str, Any]:
        """Chat's ``logprobs``: content entries with their bytes and top alternatives."""
        content = []
        for t, (lp, top) in zip(ids, lps, strict=False):
            names = self.strings(t, top)
            content.append(
                {
                    "token": names[t],
                    "logprob": lp,
                    "bytes": list(self.bytes(t)),
                    "top_logprobs": [
                        {"token": names[a], "logprob": v, "bytes": list(self.bytes(a))}
                        for a, v in top
                    ],
                }
            )
        return {"content": content}

    def prompt(self, prompt_ids: Sequence[int], plps: Sequence[Entry]) -> list[Any]:
        """The ``prompt_logprobs`` extension: None for the first prompt token, then each
        token's log-probability and the top-k there."""
        out: list[Any] = [None]
        for t, (lp, top) in zip(prompt_ids[1:], plps, strict=False):
            names = self.strings(t, top)
            out.append(
                {
                    "token": names[t],
                    "logprob": lp,
                    "top_logprobs": [{"token": names[a], "logprob": v} for a, v in top],
                }
            )
        return out
