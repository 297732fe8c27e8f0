"""Fill-in-the-middle layouts built from tokenizers that carry each family's FIM tokens, and the
``suffix`` field's validation."""

from __future__ import annotations

import functools
import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from tandem.frontend.fim import FimSpec, fim_prompt, fim_tokens
from tandem.frontend.tokenizer import Tokenizer
from tandem.server.errors import RequestError
from tandem.server.requests import parse_completion
from tandem.testing.byte_fallback import llama2_decoder

CORPUS = [
    "def add(a, b): return a + b",
    "def f(x): print(x) # the value of x",
    "for i in range(10): total = total + i",
    "class Point: pass",
]
PREFIX, SUFFIX = "def f(", "return a + b"

QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
STARCODER = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
DEEPSEEK = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")
CODELLAMA = ("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>")
MISTRAL = ("[PREFIX]", "[SUFFIX]", "[MIDDLE]")


def _wrap(raw: RawTokenizer, bos: str | None, eos: str, specials: tuple[str, ...]) -> Tokenizer:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=bos,
        eos_token=eos,
        additional_special_tokens=list(specials),
    )
    return Tokenizer(hf, {hf.convert_tokens_to_ids(eos)})


@functools.cache
def byte_level(specials: tuple[str, ...], bos: str | None = None, add_bos: bool = False):
    """A GPT-2-style byte-level BPE (Qwen, StarCoder, DeepSeek-Coder) with these specials."""
    eos = "<|endoftext|>"
    names = [eos, *([bos] if bos else []), *specials]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=names,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer=trainer)
    if add_bos:
        single = f"{bos} $A"
        raw.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(bos, raw.token_to_id(bos))]
        )
    return _wrap(raw, bos, eos, specials)


@functools.cache
def sentencepiece_like(specials: tuple[str, ...]) -> Tokenizer:
    """A Llama-style BPE: a space (▁) before every text, bytes as <0xNN> fallback pieces, BOS
    added (CodeLlama, Codestral)."""
    raw = RawTokenizer(models.BPE(byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", *specials], show_progress=False
    )
    raw.train_from_iterator(CORPUS, trainer=trainer)
    data = json.loads(raw.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    raw = RawTokenizer.from_str(json.dumps(data))
    raw.decoder = llama2_decoder()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    return _wrap(raw, "<s>", "</s>", specials)


def ids(tok: Tokenizer, *tokens: str) -> list[int]:
    return [tok.hf.convert_tokens_to_ids(t) for t in tokens]


def text(tok: Tokenizer, s: str) -> list[int]:
    return tok.encode(s, add_special_tokens=False)


def pieces(tok: Tokenizer, token_ids: list[int]) -> str:
    return "".join(tok.hf.convert_ids_to_tokens(token_ids))


def test_qwen_layout_is_prefix_suffix_middle_without_bos():
    tok = byte_level(QWEN)
    spec = fim_tokens(tok)
    assert spec is not None and spec.family == "qwen" and spec.bos_id is None
    p, s, m = ids(tok, *QWEN)
    assert fim_prompt(spec, tok, PREFIX, SUFFIX) == [
        p,
        *text(tok, PREFIX),
        s,
        *text(tok, SUFFIX),
        m,
    ]
    # The same ids as the layout written out as text.
    assert fim_prompt(spec, tok, PREFIX, SUFFIX) == tok.encode(
        f"{QWEN[0]}{PREFIX}{QWEN[1]}{SUFFIX}{QWEN[2]}"
    )


def test_starcoder_layout_has_no_bos_even_though_the_tokenizer_names_one():
    tok = byte_level(STARCODER, bos="<|endoftext|>")
    spec = fim_tokens(tok)
    assert spec is not None and spec.family == "starcoder" and spec.bos_id is None
    p, s, m = ids(tok, *STARCODER)
    assert fim_prompt(spec, tok, PREFIX, SUFFIX) == [
        p,
        *text(tok, PREFIX),
        s,
        *text(tok, SUFFIX),
        m,
    ]


def test_deepseek_layout_is_begin_prefix_hole_suffix_end_after_bos():
    bos = "<｜begin▁of▁sentence｜>"
    tok = byte_level(DEEPSEEK, bos=bos, add_bos=True)
    spec = fim_tokens(tok)
    assert spec is not None and spec.family == "deepseek"
    b, begin, hole, end = ids(tok, bos, *DEEPSEEK)
    assert spec.bos_id == b
    expected = [b, begin, *text(tok, PREFIX), hole, *text(tok, SUFFIX), end]
    assert fim_prompt(spec, tok, PREFIX, SUFFIX) == expected
    # What DeepSeek's README does: the layout as text through the tokenizer (BOS added).
    assert expected == tok.encode(f"{DEEPSEEK[0]}{PREFIX}{DEEPSEEK[1]}{SUFFIX}{DEEPSEEK[2]}")


def test_codellama_layout_spaces_the_prefix_but_not_the_suffix_and_stops_at_eot():
    tok = sentencepiece_like(CODELLAMA)
    spec = fim_tokens(tok)
    assert spec is not None and spec.family == "codellama" and spec.spaced
    bos, pre, suf, mid, eot = ids(tok, "<s>", *CODELLAMA)
    assert spec.bos_id == bos and spec.stop_ids == (eot,)
    out = fim_prompt(spec, tok, PREFIX, SUFFIX)
    assert out[:2] == [bos, pre] and out[-1] == mid
    i = out.index(suf)
    # Meta's "<PRE> {pre} <SUF>{suf} <MID>": the prefix as the tokenizer encodes it (with its
    # leading space), the suffix without one.
    assert out[2:i] == text(tok, PREFIX) and pieces(tok, out[2:i]) == "▁def▁f("
    assert pieces(tok, out[i + 1 : -1]) == "return▁a▁+▁b"


def test_mistral_layout_is_suffix_first_without_a_middle_marker():
    tok = sentencepiece_like(MISTRAL)
    spec = fim_tokens(tok)
    assert spec is not None and spec.family == "mistral"
    bos, prefix, suffix = ids(tok, "<s>", "[PREFIX]", "[SUFFIX]")
    out = fim_prompt(spec, tok, PREFIX, SUFFIX)
    i = out.index(prefix)
    assert out[:2] == [bos, suffix]
    # mistral-common's own test: "<s>[SUFFIX]return▁a▁+▁b[PREFIX]▁def▁f("
    assert pieces(tok, out) == "<s>[SUFFIX]return▁a▁+▁b[PREFIX]▁def▁f("
    assert out[i + 1 :] == text(tok, PREFIX)


def test_a_suffix_that_starts_with_a_space_keeps_it():
    tok = sentencepiece_like(CODELLAMA)
    spec = fim_tokens(tok)
    out = fim_prompt(spec, tok, "x", " return a")
    i = out.index(ids(tok, "▁<SUF>")[0])
    assert pieces(tok, out[i + 1 : -1]) == "▁return▁a"


def test_empty_prefix_is_no_tokens():
    tok = byte_level(QWEN)
    p, s, m = ids(tok, *QWEN)
    assert fim_prompt(fim_tokens(tok), tok, "", SUFFIX) == [p, s, *text(tok, SUFFIX), m]


def test_special_token_strings_in_the_code_stay_text():
    tok = byte_level(QWEN)
    out = fim_prompt(fim_tokens(tok), tok, "a = '<|fim_middle|>'", SUFFIX)
    assert out.count(ids(tok, "<|fim_middle|>")[0]) == 1  # only the marker itself


def test_a_tokenizer_without_fim_tokens_has_no_layout():
    assert fim_tokens(byte_level(("<|im_start|>", "<|im_end|>"))) is None
    assert fim_tokens(byte_level(QWEN[:2])) is None  # all markers or none


def test_fim_spec_is_frozen():
    spec = fim_tokens(byte_level(QWEN))
    assert isinstance(spec, FimSpec)
    with pytest.raises(AttributeError):
        spec.family = "x"  # type: ignore[misc]


def parse(**body):
    return parse_completion({"prompt": "def f(", **body}, vocab_size=400)


def test_suffix_is_parsed_for_every_text_prompt():
    assert parse(suffix="return x").suffix == "return x"
    req = parse_completion({"prompt": ["a", "b"], "suffix": "z"}, vocab_size=400)
    assert req.suffix == "z" and req.prompts == ["a", "b"]


def test_empty_or_null_suffix_is_a_plain_completion():
    assert parse(suffix="").suffix is None and parse(suffix=None).suffix is None
    assert parse().suffix is None


def test_an_empty_prompt_is_allowed_with_a_suffix_only():
    assert parse_completion({"prompt": "", "suffix": "x"}, vocab_size=400).prompts == [""]
    with pytest.raises(RequestError) as e:
        parse_completion({"prompt": ""}, vocab_size=400)
    assert e.value.param == "prompt"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"suffix": 3}, "suffix: Input should be a valid string"),
        ({"prompt": [1, 2, 3], "suffix": "x"}, "needs a text prompt"),
        ({"prompt": [[1, 2], [3]], "suffix": "x"}, "needs a text prompt"),
        ({"suffix": "x", "echo": True}, "'echo' cannot be combined with 'suffix'"),
        ({"suffix": "x", "echo": True, "max_tokens": 0}, "'echo' cannot be combined"),
    ],
)
def test_bad_suffix_requests_are_400s_naming_suffix(body, message):
    with pytest.raises(RequestError) as e:
        parse(**body)
    assert e.value.param == "suffix" and message in str(e.value)
