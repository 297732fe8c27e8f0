"""Where a decode step's time goes: graph build, submission (async_eval), waiting.

    python -m tandem.bench.step_profile --shape qwen3-0.6b --dtype bfloat16 --batch 1,64,256

Runs B equal prompts through the engine, then reports per-step medians over the steady
decode phase, overlap on and off.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def profile(
    path: Path, batch: int, in_len: int, steps: int, overlap: bool, double_buffer: bool | None
) -> dict[str, float]:
    import tandem.runner.model_runner as mr
    from tandem import LLM, SamplingParams

    llm = LLM(
        str(path), overlap=overlap, max_num_seqs=max(batch, 8), kv_double_buffer=double_buffer
    )
    runner = llm.engine.loop.runner
    rec: dict[str, list[float]] = {"build": [], "submit": [], "wait": [], "step": []}
    real_async_eval, real_launch, real_finalize = mr.mx.async_eval, runner.launch, runner.finalize
    t_sub = [0.0]

    def async_eval(*arrays):
        t = time.perf_counter()
        real_async_eval(*arrays)
        t_sub[0] += time.perf_counter() - t

    def launch(plan, parent):
        t_sub[0] = 0.0
        t = time.perf_counter()
        h = real_launch(plan, parent)
        if not plan.chunks:
            rec["submit"].append(t_sub[0])
            rec["build"].append(time.perf_counter() - t - t_sub[0])
        return h

    def finalize(h):
        t = time.perf_counter()
        r = real_finalize(h)
        if not h.plan.chunks:
            rec["wait"].append(time.perf_counter() - t)
        return r

    mr.mx.async_eval, runner.launch, runner.finalize = async_eval, launch, finalize
    try:
        prompts = [[10 + (i * 7 + j) % 400 for j in range(in_len)] for i in range(batch)]
        sp = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for v in rec.values():
            v.clear()
        t = time.perf_counter()
        llm.generate(prompts, sp)
        total = time.perf_counter() - t
    finally:
        mr.mx.async_eval = real_async_eval
    out = {k: statistics.median(v) * 1e3 for k, v in rec.items() if v}
    out["tok_s"] = batch * steps / total
    return out


def main() -> None:
    import tandem.runner  # noqa: F401
    from tandem.bench.offline import make_model

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument(
        "--single-buffer-too",
        action="store_true",
        help="also run overlap on with one KV buffer set",
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(a.shape, a.dtype, Path(tmp))
        for b in [int(x) for x in a.batch.split(",")]:
            modes = [(True, None), (False, None)] + ([(True, False)] if a.single_buffer_too else [])
            for overlap, double in modes:
                r = profile(path, b, a.input_len, a.steps, overlap, double)
                cells = "  ".join(f"{k}={v:.2f}" for k, v in r.items())
                name = ("on " if overlap else "off") + (" 1buf" if double is False else "")
                print(f"B={b:<4} overlap={name} ms/step: {cells}", flush=True)


if __name__ == "__main__":
    main()
