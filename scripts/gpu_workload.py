"""What the GPU checks share (scripts/gpu_inplace_check.py, scripts/gpu_determinism.py): the
family models with heads wide enough for MLX's CUDA rope, and one staggered workload."""

from __future__ import annotations

import random
from pathlib import Path

from tandem import SamplingParams
from tandem.testing import families, model_zoo, tiny_models

# MLX's CUDA rope faults when it rotates 16 dims or fewer of (T, H, 1, D) queries with an
# offset per token, the layout of a step of two or more prompts (scripts/gpu_rope_hd16.py):
# on the H200 (fc32873) the families' 16-wide heads (deepseek_v3: 8 rope dims) failed every
# unchunked prefill of several prompts. Here their heads are 32 wide.
WIDER = {"head_dim": 32, "qk_rope_head_dim": 32}


def family_model(root: Path, fam: str) -> Path:
    """A tiny float32 model of family ``fam`` (families.py) with 32-wide heads."""
    if fam in families.CHUNKED:  # (llama4, a zoo model)
        over = {"text_config": {"head_dim": 32, "floor_scale": 4}}
        return model_zoo.make_zoo_model(root / fam, fam, overrides=over)
    config = families.family_config(fam)
    config.update({k: v for k, v in WIDER.items() if k in config})
    return tiny_models.write_model(root / fam, config)


def requests(n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` greedy requests of 43-342 tokens sharing a 40-token prefix (prefix hits on a
    second pass), 8-47 tokens out each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 500) for _ in range(40)]
    prompts = [
        prefix + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 300))] for _ in range(n)
    ]
    params = [
        SamplingParams(max_tokens=rng.randrange(8, 48), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def mlx_lm_greedy(model, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """mlx-lm's ``generate_step`` on each prompt, one at a time: the reference outputs."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [
        [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=sp.max_tokens)]
        for p, sp in zip(prompts, params, strict=True)
    ]
