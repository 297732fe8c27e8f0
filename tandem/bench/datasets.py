"""Prompt sets for the serving benchmark, built with the served model's tokenizer so prompt
lengths are exact in tokens. No mlx."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from tandem.frontend.tokenizer import Tokenizer

_WORD = re.compile(r"^ [a-z]{2,8}$")


@dataclass
class RequestSpec:
    prompt: str  # completions prompt, or the first user message
    output_len: int
    prompt_len: int
    turns: list[str] = field(default_factory=list)  # multi-turn: later user messages
    group: int = -1  # shared-prefix: which prefix


class TextMaker:
    """Random text of an exact token length (words that re-tokenize stably)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        vocab = tokenizer.hf.get_vocab()
        words = [i for i in sorted(vocab.values()) if _WORD.match(tokenizer.decode([i]))]
        if len(words) < 50:  # tiny vocabularies: take any clean token
            words = [
                i
                for i in sorted(vocab.values())
                if re.fullmatch(r" ?[A-Za-z]+", tokenizer.decode([i]) or "")
            ]
        if not words:
            raise ValueError("tokenizer has no plain word tokens to build prompts from")
        self.words = words

    def make(self, n: int, rng: random.Random) -> str:
        ids = [rng.choice(self.words) for _ in range(n)]
        for _ in range(8):
            text = self.tok.decode(ids)
            enc = self.tok.encode(text, add_special_tokens=False)
            if len(enc) == n:
                return text
            ids = enc[:n] + [rng.choice(self.words) for _ in range(n - len(enc))]
        return self.tok.decode(ids)

    def length(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


def random_dataset(
    maker: TextMaker, n: int, input_len: int, output_len: int, seed: int
) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        text = maker.make(input_len, rng)
        specs.append(RequestSpec(text, output_len, maker.length(text)))
    return specs


def shared_prefix_dataset(
    maker: TextMaker,
    n: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: int,
    output_len: int,
    seed: int,
) -> list[RequestSpec]:
    """``num_prefixes`` long prefixes, each request one of them plus its own suffix."""
    rng = random.Random(seed)
    prefixes = [maker.make(prefix_len, rng) for _ in range(num_prefixes)]
    specs = []
    for i in range(n):
        g = i % num_prefixes
        text = prefixes[g] + maker.make(suffix_len, rng)
        specs.append(RequestSpec(text, output_len, maker.length(text), group=g))
    rng.shuffle(specs)
    return specs


def multi_turn_dataset(
    maker: TextMaker, n: int, turns: int, input_len: int, output_len: int, seed: int
) -> list[RequestSpec]:
    """``n`` conversations of ``turns`` user messages; each turn resends the history."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        msgs = [maker.make(input_len, rng) for _ in range(turns)]
        specs.append(RequestSpec(msgs[0], output_len, input_len, turns=msgs[1:]))
    return specs
