"""Random-weight models of real architectures, written on the spot (never downloaded).

``make_tiny_model`` writes a float32 model of a few hundred KB that ``mlx_lm.utils.load``
loads like a real checkpoint: config, safetensors, a byte-level BPE ``tokenizer.json`` trained
here on a built-in corpus, a ChatML chat template and a generation config. Weights are scaled
so greedy decoding gives varied tokens. ``make_random_model`` writes real shapes (e.g.
``QWEN3_8B``) in the target dtype, shard by shard, for benchmarks.

Weights are written in mlx-lm's own (already sanitized) layout: the parameter tree of the
mlx-lm ``Model`` class. That equals the Hugging Face names except for ``qwen3_moe``, whose
experts are stacked as ``mlp.switch_mlp.{gate,up,down}_proj.weight`` of shape (E, out, in).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# isort: off
import tandem.runner  # noqa: F401  (preloads an optimized BLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# isort: on

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Real Hugging Face values (Qwen/Qwen3-0.6B, Qwen/Qwen3-8B config.json); use as overrides
# for ``make_random_model(path, "qwen3", QWEN3_8B)``.
QWEN3_0_6B: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
QWEN3_8B: dict[str, Any] = {
    **QWEN3_0_6B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_DEFAULT_TIE = {"llama": False, "qwen2": True, "qwen3": True, "qwen3_moe": False}
_SHARD_BYTES = 2 << 30

# (name, shape) -> the std of a uniform init, None for ones, or the array itself.
Init = Callable[[str, tuple[int, ...]], "float | mx.array | None"]

CORPUS = """\
The morning train left the station at seven, and the small town slowly woke behind it.
Bakers opened their doors, children walked to school, and the river carried the light of
the rising sun past the old stone bridge. Nobody in the town was in a hurry, because the
day was long and the work would still be there after a cup of coffee and a piece of bread.

A language model reads a sequence of tokens and predicts the next one. It turns every token
into a vector, mixes the vectors with attention, and passes them through many layers before
it writes a probability for each word in its vocabulary. Inference engines keep a cache of
keys and values, so that each new token only needs one more step instead of the whole prompt.
Batching many requests together keeps the hardware busy, and scheduling decides which
request runs next. Good servers measure latency, throughput, memory and the time to the
first token, and they compare their outputs with a reference to be sure nothing is broken.

Once upon a time there was a curious fox who lived at the edge of a quiet forest. Every
evening she climbed the hill to watch the stars, counting them one by one until she fell
asleep. One night a bright comet crossed the sky, and the fox decided to follow it. She ran
through fields of tall grass, across cold streams and over sleeping villages, asking the owls
and the rabbits where the comet had gone. Nobody knew, but everybody wanted to help her.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Why is the sky blue? Answer: Sunlight is scattered by the air, and blue light is
scattered more than red light, so the sky looks blue during the day.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

print(fibonacci(10))  # 55

Numbers and dates appear everywhere: 1, 2, 3, 42, 100, 2024, 3.14159, 1,000,000 and 0.5.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday make a week. January,
February, March, April, May, June, July, August, September, October, November, December.

Hello! How are you today? I am fine, thank you. Could you please help me write a short
letter to my friend? Of course. Dear Anna, thank you for your kind message. I hope you and
your family are well, and I would love to visit you next summer when the weather is warm.
Best wishes, Tom.

The committee reviewed the proposal carefully and agreed that the new library should be
built near the park. Construction will begin in the spring, and the building should open
before the end of next year. Volunteers are welcome to join the planning group, which meets
every Thursday evening in the community hall.

Water boils at one hundred degrees Celsius at sea level. Plants need light, water and air to
grow. The heart pumps blood through the body, and the lungs bring oxygen into the blood.
Mountains are formed when the plates of the earth push against each other over millions of
years, and rivers slowly carve valleys into the rock.
"""


def _base_config(
    arch: str, vocab_size: int, hidden_size: int, num_layers: int, tie: bool | None
) -> dict[str, Any]:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    heads = 4
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": hidden_size // heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": _DEFAULT_TIE[arch] if tie is None else tie,
    }
    if arch in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
    if arch == "qwen3_moe":
        config.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    return config


@functools.lru_cache(maxsize=8)
def _tokenizer_json(trained_vocab: int, total_vocab: int, extra_special: tuple[str, ...]) -> str:
    """Byte-level BPE trained on CORPUS up to ``trained_vocab`` ids, then padded with
    never-produced (but decodable) tokens to exactly ``total_vocab`` ids. ``extra_special``
    tokens follow SPECIAL_TOKENS (e.g. fill-in-the-middle markers)."""
    special = (*SPECIAL_TOKENS, *extra_special)
    if trained_vocab > total_vocab:
        raise ValueError(f"tokenizer vocab {trained_vocab} exceeds model vocab {total_vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=trained_vocab,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    base = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special]
    fill = ("".join(p) for r in itertools.count(2) for p in itertools.product(base, repeat=r))
    while len(vocab) < total_vocab:
        token = next(fill)
        if token not in vocab:
            vocab[token] = len(vocab)
    return json.dumps(data, ensure_ascii=False)


def _write_tokenizer(
    path: Path,
    trained_vocab: int,
    total_vocab: int,
    extra_special: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> dict[str, int]:
    text = _tokenizer_json(trained_vocab, total_vocab, extra_special)
    additional = [*SPECIAL_TOKENS[1:], *extra_special]
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = {t: Tokenizer.from_str(text).token_to_id(t) for t in SPECIAL_TOKENS}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": chat_template,
        "additional_special_tokens": additional,
    }
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": additional,
    }
    _dump(path / "tokenizer_config.json", tok_config)
    _dump(path / "special_tokens_map.json", special_map)
    return ids


def _dump(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def init_std(name: str, shape: tuple[int, ...], tied: bool) -> float | None:
    """Std of the (zero-mean, uniform) init, or None for ones (the norms).

    Linears get 1/sqrt(fan_in) and biases 0.1. Embeddings get 1.0, or 0.2 when tied to the
    output, and the final norm's weight has std 1: with tied embeddings, h . E_x for the
    current token x would otherwise dominate and greedy decoding would repeat one token.
    """
    if name == "model.norm.weight":
        return 1.0
    if name.endswith("norm.weight"):
        return None
    if "embed_tokens" in name:
        return 0.2 if tied else 1.0
    if name.endswith(".bias"):
        return 0.1
    return 1.0 / math.sqrt(shape[-1])


def _write_weights(
    path: Path, config: dict[str, Any], seed: int, dtype: mx.Dtype, init: Init | None = None
) -> None:
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    # mlx is lazy: the Model's own init arrays are never evaluated, only their shapes read.
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = [(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())]
    del model
    if init is None:
        init = functools.partial(init_std, tied=bool(config["tie_word_embeddings"]))
    keys = mx.random.split(mx.random.key(seed), len(params))

    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(params):
        nbytes = math.prod(shape) * dtype.size
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes

    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s, idx in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, mx.array] = {}
        for i in idx:
            name, shape = params[i]
            std = init(name, shape)
            if isinstance(std, mx.array):
                w = std.astype(dtype)
            elif std is None:
                w = mx.ones(shape, dtype=dtype)
            else:
                a = std * math.sqrt(3.0)  # uniform: 3x faster than normal on CPU
                w = mx.random.uniform(-a, a, shape, dtype=dtype, key=keys[i])
            mx.eval(w)
            tensors[name] = w
            weight_map[name] = fname
            total += w.nbytes
        mx.save_safetensors(str(path / fname), tensors, metadata={"format": "mlx"})
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _dump(path / "model.safetensors.index.json", index)


def _write_model(
    path: Path,
    config: dict[str, Any],
    seed: int,
    dtype: str,
    tokenizer_vocab: int,
    extra_special: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
    init: Init | None = None,
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(
        path, tokenizer_vocab, config["vocab_size"], extra_special, chat_template
    )
    eos = ids[EOS_TOKEN]
    config = {**config, "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": eos}
    _dump(path / "config.json", config)
    _dump(path / "generation_config.json", {"bos_token_id": None, "eos_token_id": eos})
    _write_weights(path, config, seed, getattr(mx, dtype), init)
    return path


def write_model(
    path: Path, config: dict[str, Any], *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write a random-weight model of any mlx-lm ``config`` (its ``model_type``; a 512-token
    BPE tokenizer padded to the vocabulary)."""
    return _write_model(path, config, seed, dtype, 512)


def make_tiny_model(
    path: Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool | None = None,
    extra_special_tokens: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write a tiny random ``arch`` model (4 heads, 2 kv heads) into ``path``; returns it.
    ``extra_special_tokens`` (e.g. fill-in-the-middle markers) join the tokenizer's special
    tokens; ``chat_template`` replaces the ChatML one."""
    config = _base_config(arch, vocab_size, hidden_size, num_layers, tie_word_embeddings)
    return _write_model(
        path, config, seed, dtype, vocab_size, tuple(extra_special_tokens), chat_template
    )


def make_random_model(
    path: Path,
    arch: str,
    config_overrides: dict[str, Any],
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    tokenizer_vocab: int = 512,
    init: Init | None = None,
) -> Path:
    """Write a random-weight ``arch`` model with real shapes, e.g. ``QWEN3_8B``; ``init``:
    each tensor's std (see ``init_std``, the default) or its value.

    The tokenizer is a BPE of ``tokenizer_vocab`` trained ids padded with filler tokens to
    the model's vocab_size, so every id the model can emit decodes. Weights are generated one
    tensor at a time and written in shards of at most 2 GiB, bounding peak memory.
    """
    config = _base_config(arch, 512, 64, 2, None)
    config.update(config_overrides)
    return _write_model(path, config, seed, dtype, tokenizer_vocab, init=init)
