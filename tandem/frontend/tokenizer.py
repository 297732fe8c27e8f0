"""Tokenizer, chat template and EOS ids for a model directory or a GGUF file. No mlx."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


class Tokenizer:
    def __init__(self, hf: Any, eos_token_ids: set[int]) -> None:
        self.hf = hf
        self.eos_token_ids = frozenset(eos_token_ids)

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        if path.is_file():
            from tandem.frontend.gguf_meta import read_gguf_metadata
            from tandem.frontend.gguf_tokenizer import eos_token_ids, tokenizer_from_gguf

            meta = read_gguf_metadata(path)
            return cls(tokenizer_from_gguf(meta, path), set(eos_token_ids(meta)))
        from transformers import AutoTokenizer

        # Never run code shipped with a model folder (no trust_remote_code).
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        eos = _ids(hf.eos_token_id)
        for name in ("generation_config.json", "config.json"):
            f = path / name
            if f.is_file():
                eos |= _ids(json.loads(f.read_text()).get("eos_token_id"))
        return cls(hf, eos)

    def save(self, directory: Path) -> list[str]:
        """Write this tokenizer as a Hugging Face folder (tokenizer.json, tokenizer_config.json
        with the chat template, and the EOS ids in generation_config.json), loadable by
        ``AutoTokenizer.from_pretrained`` and by ``Tokenizer.load``. Returns the files written."""
        directory.mkdir(parents=True, exist_ok=True)
        files = [Path(f).name for f in self.hf.save_pretrained(str(directory))]
        eos = sorted(self.eos_token_ids)
        (directory / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2) + "\n"
        )
        return sorted(set(files) | {"generation_config.json"})

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template")
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        return self.encode(text, add_special_tokens=add_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, holding back incomplete UTF-8.

    The tokens of the last output (its window; at first, the prompt's last few) are decoded
    with the new ones after them; once that text is longer than the window's own and does not
    end in U+FFFD, what it adds is output and the window moves on. A fast tokenizer with no
    Python-side clean-up has tokenizers' ``DecodeStream`` do this in Rust (one call per
    ``add``); any other decodes twice per ``add`` here. The windows are tracked either way:
    where a window's text is not a prefix of the longer text (an ill-formed byte run under
    byte fallback) the stream raises, and the rest of the request is decoded here from the
    same window, so the text never depends on which of the two ran.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        # A few prompt tokens of context make leading-space handling match a full decode.
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids else []
        # The last output's window is ids[prefix_offset:read_offset].
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._stream = self._open_stream()

    def _open_stream(self) -> Any:
        from tokenizers.decoders import DecodeStream
        from transformers import PreTrainedTokenizerFast

        hf = self.tokenizer.hf
        if not isinstance(hf, PreTrainedTokenizerFast) or hf.clean_up_tokenization_spaces:
            return None
        # A context ending inside a character stays the window here (the character's end is
        # not output); the stream would drop that window and output the whole character.
        if self.ids and self._decode(self.ids).endswith("\ufffd"):
            return None
        try:
            return DecodeStream(self.ids, skip_special_tokens=self.skip_special)
        except TypeError:  # tokenizers before 0.23 (e.g. a device image's): no prompt context
            return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _window_texts(self) -> tuple[str, str]:
        """The last output's window decoded, and the window with every token after it."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return prefix, self._decode(self.ids[self.prefix_offset :])

    def add(self, new_ids: list[int] | tuple[int, ...]) -> str:
        self.ids.extend(new_ids)
        if not new_ids:
            return ""  # nothing new to decode (a trailing stop token was removed)
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.hf.backend_tokenizer, list(new_ids))
            except Exception as e:  # tokenizers raises its InvalidPrefix as a plain Exception
                if "Invalid prefix" not in str(e):
                    raise
                self._stream = None  # see the class docstring
            else:
                if text is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text
        prefix, full = self._window_texts()
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def finish(self) -> str:
        """At the output's end: what ``add`` still holds back, as a full decode has it. The
        held text ends in U+FFFD: a replacement character the model wrote, or the bytes of
        a character the output stopped inside (max_tokens). Nothing is added after this."""
        prefix, full = self._window_texts()
        self._stream = None
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
