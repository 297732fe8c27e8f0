"""Greedy output with and without fused projections (runner/fused_proj.py), one process
each: where the first token differs per prompt (bf16 on a GPU may round a fused matmul
differently; float32 on the CPU should not differ at all).

    python scripts/fused_divergence.py MODEL_DIR OUT.json [PROMPTS] [TOKENS]
"""

from __future__ import annotations

import json
import subprocess
import sys


def run(model: str, fused: bool, prompts: int, tokens: int) -> list[list[int]]:
    code = (
        "import json, random, sys\n"
        "from tandem import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, fuse_projections={int(fused)})\n"
        "ps = [[random.Random(i).randrange(10, 500) for _ in range(32)]\n"
        f"      for i in range({prompts})]\n"
        f"sp = SamplingParams(max_tokens={tokens}, temperature=0, ignore_eos=True)\n"
        "out = [llm.generate([p], sp)[0].token_ids for p in ps]\n"
        "print('@@' + json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.split("@@")[-1])


def main() -> None:
    model, path = sys.argv[1], sys.argv[2]
    prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    off, on = run(model, False, prompts, tokens), run(model, True, prompts, tokens)
    first = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(off, on, strict=True)
    ]
    result = {"model": model, "tokens": tokens, "first_difference": first}
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(result)


if __name__ == "__main__":
    main()
