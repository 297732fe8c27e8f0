"""In-place KV writes (runner/kv_write.py) against MLX scatters, token for token, on the GPU
(and, on the recurrent models, recurrent states stored in place: runner/state.py).

    python scripts/gpu_inplace_check.py [OUT.json]

Tiny float32 models of each attention path (the decode kernel at head dim 64; gathers for
head dim 16, sliding windows, sinks, chunks, MLA rows, recurrent layers), each run with in-place
writes and without, over staggered requests that share a prefix (prefix hits on the second
pass), with overlap on and off, chunked prefill and int8 pages. Prints mismatches; a row is
exact when every output is identical.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

# float32 matmuls in full precision: with TF32 (MLX's CUDA default) a fused matmul may
# round differently from its parts, and the sliding-window models differed by that alone.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import tandem.runner  # noqa: F401, E402  (preloads BLAS before mlx)

# isort: split
import gpu_workload  # noqa: E402 - scripts/, beside this file

from tandem import LLM
from tandem.testing import families, tiny_models

root = Path(tempfile.mkdtemp())
models = {
    "qwen3-hd64": tiny_models.make_random_model(
        root / "qwen3",
        "qwen3",
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 512,
        },
        dtype="float32",
    ),
    # No decode kernel at head dim 32: the gather path.
    "llama-hd32": tiny_models.make_random_model(
        root / "llama",
        "llama",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
        dtype="float32",
    ),
}
for fam in ("gemma3_text", "gpt_oss", "llama4", "deepseek_v3", "qwen3_next", "falcon_h1"):
    models[fam] = gpu_workload.family_model(root, fam)


def chosen(var: str, names: list[str]) -> list[str]:
    """The names listed in environment variable ``var`` (all when unset); an unknown one
    is an error, not a row quietly left out."""
    if not os.environ.get(var):
        return names
    want = os.environ[var].split(",")
    unknown = set(want) - set(names)
    assert not unknown, f"{var}: unknown {sorted(unknown)} (known: {names})"
    return want


models = {k: models[k] for k in chosen("MODELS", list(models))}

prompts, params = gpu_workload.requests()
# Uncompiled unless the row says so (compiled steps are the CUDA default for up to 8 rows).
configs = {
    "default": {"compile_decode": 0},
    "overlap-off": {"overlap": False, "compile_decode": 0},
    "chunked-64": {"max_num_batched_tokens": 64, "compile_decode": 0},
    "int8": {"kv_cache_dtype": "int8"},  # (compiled where the default compiles: CUDA)
    # Compiled decode steps (runner/static_decode.py) against uncompiled scatters.
    "compiled": {"compile_decode": True},
    "compiled-overlap-off": {"compile_decode": True, "overlap": False},
    "compiled-chunked-64": {"compile_decode": True, "max_num_batched_tokens": 64},
    # q/k/v and gate/up as one matmul (runner/fused_proj.py), one row and up to 8 rows.
    "fused-1": {"fuse_projections": 1},
    "fused-8": {"fuse_projections": 8},
    # The model drafting for itself: its draft pool is written in place too; acceptance
    # near 100% says the draft's KV was all written.
    "self-draft": {"speculative": "draft", "num_speculative_tokens": 4, "compile_decode": 0},
    # The same with both models' steady steps compiled (the draft's proposals after its first).
    "compiled-self-draft": {
        "speculative": "draft",
        "num_speculative_tokens": 4,
        "compile_decode": True,
    },
    # n-gram verifies on the recurrent models: rejected proposals roll the state back from
    # each verify's backup and replay (engine/results.py); equal to "default" too.
    "ngram": {
        "speculative": "ngram",
        "num_speculative_tokens": 4,
        "speculative_max_batch": 8,
        "compile_decode": 0,
    },
}


def mismatches(a: list, b: list) -> int:
    """Outputs that differ between two runs' passes."""
    return sum(x != y for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


failures = 0
rows = []
for name, path in models.items():
    names = list(configs) if name == "qwen3-hd64" else ["default", "chunked-64", "compiled"]
    if name in families.RECURRENT:
        names.append("ngram")
    if os.environ.get("CONFIGS"):  # e.g. CONFIGS=chunked-64,compiled-chunked-64
        names = chosen("CONFIGS", list(configs))
    plain = None  # the "default" row's outputs
    for cname in names:
        opts = dict(configs[cname])
        if opts.get("speculative") == "draft":
            opts["draft_model"] = str(path)
        outs, active, failed = {}, {}, {}
        for inplace in (None, False):
            # (The reference side: scatters, uncompiled, unfused.)
            o = dict(opts) if inplace is None else {**opts, "compile_decode": False}
            if inplace is False:
                o["fuse_projections"] = 0
            try:
                llm = LLM(str(path), max_num_seqs=8, kv_inplace_writes=inplace, **o)
            except Exception as e:  # noqa: BLE001
                outs[inplace] = f"load failed: {type(e).__name__}: {e}"
                continue
            runner = llm.engine.loop.runner
            static = runner.static  # (a failed step turns it off: runner.static is None then)
            active[inplace] = [runner.pool.inplace, bool(runner.decode_kernel), None]
            got = []
            for _ in range(2):  # the second pass hits the prefix cache
                res = llm.generate(prompts, params)
                got.append([r.token_ids for r in res])
            outs[inplace] = got
            stats = llm.engine.scheduler.stats
            failures += stats.step_failures
            failed[inplace] = stats.step_failures
            if stats.spec_proposed:
                active[inplace].append(round(stats.spec_accepted / stats.spec_proposed, 3))
            if static is not None:
                active[inplace][2] = [static.traces, static.replays]
            if runner.state_pool is not None:  # recurrent states stored in place too
                active[inplace].append({"states_inplace": runner.state_pool.inplace})
            del llm
        a, b = outs.get(None), outs.get(False)
        if isinstance(a, str) or isinstance(b, str):
            row = {"model": name, "config": cname, "error": a if isinstance(a, str) else b}
        else:
            diff = mismatches(a, b)
            row = {
                "model": name,
                "config": cname,
                "inplace_active": active[None],
                "scatter_active": active[False],
                "mismatched_outputs": diff,
                "outputs": 2 * len(prompts),
                "failed_steps": [failed[None], failed[False]],
            }
            if cname == "default":
                plain = a
            elif cname == "ngram" and plain is not None:
                row["mismatched_vs_default"] = mismatches(a, plain)
        print(json.dumps(row), flush=True)
        rows.append(row)
if len(sys.argv) > 1:
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
bad = [
    r
    for r in rows
    if r.get("mismatched_outputs", 1)
    or r.get("mismatched_vs_default")
    or any(r.get("failed_steps", ()))
]
assert rows, "no rows ran"
print("ALL EXACT" if not bad else f"{len(bad)} rows not exact", f"(failed steps: {failures})")
