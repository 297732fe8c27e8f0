"""Greedy output with a change off and on, one process each: where the first token differs
per prompt, each prompt alone (single-stream steps) and all together (batched steps).
bf16 on a GPU may round a reordered product differently; float32 on the CPU should not
differ at all, nor should a change that runs the same kernels (the weight views).

    [WHAT=...] python scripts/fused_divergence.py MODEL_DIR OUT.json [PROMPTS] [TOKENS]

WHAT=fused (the default): ``fuse_projections`` 0 against 1 (runner/fused_proj.py).
WHAT=views: ``TANDEM_WEIGHT_VIEWS=0`` against the default (runner/weight_views.py).
WHAT=compiled: ``compile_decode=0`` against the default (runner/static_decode.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(model: str, what: str, on: bool, prompts: int, tokens: int) -> dict[str, list]:
    options = {
        "fused": f"fuse_projections={int(on)}",
        "views": "",
        "compiled": "" if on else "compile_decode=0",
    }[what]
    env = dict(os.environ)
    env.pop("TANDEM_WEIGHT_VIEWS", None)
    if what == "views" and not on:
        env["TANDEM_WEIGHT_VIEWS"] = "0"
    code = (
        "import json, random, sys\n"
        "from tandem import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, {options})\n"
        "ps = [[random.Random(i).randrange(10, 500) for _ in range(32)]\n"
        f"      for i in range({prompts})]\n"
        f"sp = SamplingParams(max_tokens={tokens}, temperature=0, ignore_eos=True)\n"
        "single = [llm.generate([p], sp)[0].token_ids for p in ps]\n"
        "batch = [o.token_ids for o in llm.generate(ps, sp)]\n"
        "print('@@' + json.dumps({'single': single, 'batch': batch}))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(r.stdout.split("@@")[-1])


def first_differences(off: list[list[int]], on: list[list[int]]) -> list[int | None]:
    return [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(off, on, strict=True)
    ]


def main() -> None:
    model, path = sys.argv[1], sys.argv[2]
    prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    what = os.environ.get("WHAT", "fused")
    assert what in ("fused", "views", "compiled"), what
    off, on = (run(model, what, flag, prompts, tokens) for flag in (False, True))
    result = {
        "model": model,
        "what": what,
        "tokens": tokens,
        "first_difference": first_differences(off["single"], on["single"]),
        "first_difference_batched": first_differences(off["batch"], on["batch"]),
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(result)


if __name__ == "__main__":
    main()
