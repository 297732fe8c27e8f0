"""Which mlx-lm model types Tandem runs: greedy parity on a tiny random model of each.

For every text ``model_type`` of the installed mlx-lm (``tandem.testing.model_zoo``), in a
fresh subprocess each (a crash or a hang costs that type only): write a tiny random-weight
model, take mlx-lm's greedy ``generate_step`` output as the reference, then run Tandem's
offline API on the same prompt and on four staggered prompts of different lengths, and
record the outcome:

* ``supported``: every output token-exact with mlx-lm;
* ``refused``: Tandem raised a ValueError at load (its message is quoted);
* ``fails``: Tandem loaded it but crashed, hung or gave other tokens (which, and where);
* ``no tiny config``: no tiny model of it could be built or run with mlx-lm itself;
* ``not a text model``: its Model needs more than token ids.

    python -m tandem.bench.models --out docs/models.md [--types a,b,c] [--jobs N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMEOUT_S = 120.0
PROMPT_LEN = 40
MAX_TOKENS = 24
BATCH_LENS = (5, 17, 33, 52)  # the staggered batch: one prompt joins every other step
# A small pool (the default sizes one for 256 sequences of the model's full length).
ENGINE_OPTIONS: dict[str, Any] = {
    "check_invariants": True,
    "kv_budget_tokens": 8192,
    "max_num_seqs": 8,
}
STATUSES = ("supported", "refused", "fails", "no tiny config", "not a text model")
_MARK = "@@"


@dataclass
class Result:
    model_type: str
    status: str
    detail: str = ""
    seconds: float = 0.0


def _trim(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error(e: BaseException) -> str:
    return _trim(f"{type(e).__name__}: {e}")


def _first_difference(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def prompts(model_type: str, vocab: int) -> tuple[list[int], list[list[int]]]:
    """The single prompt and the batch's prompts, ids in [3, vocab), fixed per type."""
    rng = random.Random(f"zoo:{model_type}")
    single = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
    batch = [[rng.randrange(3, vocab) for _ in range(n)] for n in BATCH_LENS]
    return single, batch


def _phase(name: str) -> None:
    print(f"{_MARK}phase {name}", flush=True)


def _run_staggered(llm: Any, batch: list[list[int]], params: Any) -> dict[int, list[int]]:
    """Prompt i joins at step 2*i, beside the decodes of the earlier ones."""
    engine = llm.engine
    ids: dict[str, int] = {}
    got: dict[int, list[int]] = {i: [] for i in range(len(batch))}
    step = 0
    while len(ids) < len(batch) or engine.has_unfinished():
        if step % 2 == 0 and step // 2 < len(batch):
            ids[engine.add_request(batch[step // 2], params)] = step // 2
        for out in engine.step():
            got[ids[out.request_id]] += out.new_token_ids
        engine.check_invariants()
        step += 1
        if step > 50 * MAX_TOKENS:
            raise RuntimeError(f"the batch did not finish in {step} steps")
    return got


def _reference(model: Any, prompt: list[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)
    return [int(t) for t, _ in gen]


def run_one(model_type: str, mlx_only: bool = False) -> Result:
    """Build, reference and check one type in this process (the subprocess's job)."""
    # isort: off
    import tandem.runner  # noqa: F401  (BLAS preload before mlx)
    import mlx.core as mx
    from mlx_lm.utils import load

    from tandem.testing import model_zoo

    # isort: on

    if model_type in model_zoo.NOT_TEXT:
        return Result(model_type, "not a text model", model_zoo.NOT_TEXT[model_type])
    with tempfile.TemporaryDirectory(prefix=f"zoo-{model_type}-") as tmp:
        _phase("build")
        said = io.StringIO()  # what a module prints before it exits (a missing package)
        try:
            with contextlib.redirect_stdout(said):
                path = model_zoo.make_zoo_model(Path(tmp) / "model", model_type)
        except BaseException as e:  # noqa: BLE001 - SystemExit too
            printed = f" (printed: {_trim(said.getvalue(), 120)})" if said.getvalue() else ""
            return Result(model_type, "no tiny config", f"build: {_error(e)}{printed}")
        _phase("mlx-lm")
        single, batch = prompts(model_type, model_zoo.VOCAB)
        try:
            model = load(str(path))[0]
            model_zoo.check_loaded(path, model, model_type)
            logits = model(mx.array(single)[None])
            # NaN is broken; -inf is a logit a model masks on purpose (phi3small).
            if bool(mx.any(mx.isnan(logits))) or not bool(mx.any(mx.isfinite(logits))):
                return Result(model_type, "no tiny config", "mlx-lm: NaN logits")
            want = _reference(model, single)
            want_batch = [_reference(model, p) for p in batch]
        except BaseException as e:  # noqa: BLE001
            return Result(model_type, "no tiny config", f"mlx-lm: {_error(e)}")
        if mlx_only:
            return Result(model_type, "mlx-lm only", f"{len(set(want))} distinct tokens")
        del model
        result = _run_tandem(model_type, path, single, batch, want, want_batch)
    if len(set(want)) < 4:
        result.detail = (
            f"{result.detail} (a weak check: the reference has {len(set(want))} distinct tokens)"
        )
    return result


def _run_tandem(
    model_type: str,
    path: Path,
    single: list[int],
    batch: list[list[int]],
    want: list[int],
    want_batch: list[list[int]],
) -> Result:
    from tandem import LLM, SamplingParams

    _phase("tandem load")
    try:
        llm = LLM(str(path), **ENGINE_OPTIONS)
    except ValueError as e:
        return Result(model_type, "refused", _trim(str(e)))
    except BaseException as e:  # noqa: BLE001
        return Result(model_type, "fails", f"crash at load: {_error(e)}")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    _phase("tandem single prompt")
    try:
        got = llm.generate([single], params)[0].token_ids
    except BaseException as e:  # noqa: BLE001
        return Result(model_type, "fails", f"crash on the single prompt: {_error(e)}")
    at = _first_difference(got, want)
    if at is not None:
        return Result(
            model_type, "fails", f"mismatch on the single prompt: first differing token {at}"
        )
    _phase("tandem staggered batch")
    try:
        got_batch = _run_staggered(llm, batch, params)
    except BaseException as e:  # noqa: BLE001
        return Result(model_type, "fails", f"crash on the staggered batch: {_error(e)}")
    for i, ref in enumerate(want_batch):
        at = _first_difference(got_batch[i], ref)
        if at is not None:
            detail = (
                f"mismatch on batch prompt {i} ({len(batch[i])} tokens): first differing token {at}"
            )
            return Result(model_type, "fails", detail)
    return Result(model_type, "supported")


def _worker(model_type: str, mlx_only: bool) -> None:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    result = run_one(model_type, mlx_only)
    print(_MARK + "result " + json.dumps(result.__dict__), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (some extension modules crash in it)


def run_isolated(model_type: str, timeout: float = TIMEOUT_S, mlx_only: bool = False) -> Result:
    """``run_one`` in a fresh interpreter; a crash or a hang becomes this type's result."""
    cmd = [sys.executable, "-m", "tandem.bench.models", "--worker", model_type]
    if mlx_only:
        cmd.append("--mlx-only")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err, code = "", None
    seconds = time.monotonic() - start
    phases = re.findall(rf"^{_MARK}phase (.+)$", out, re.M)
    found = re.findall(rf"^{_MARK}result (.+)$", out, re.M)
    if found:
        result = Result(**json.loads(found[-1]))
        result.seconds = seconds
        return result
    phase = phases[-1] if phases else "start"
    if code is None:
        what = f"timed out after {timeout:.0f} s in {phase}"
    else:
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:]
        what = f"process died (exit {code}) in {phase}" + (f": {tail[0]}" if tail else "")
    status = "fails" if phase.startswith("tandem") else "no tiny config"
    return Result(model_type, status, _trim(what), seconds)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _tandem_revision() -> str:
    try:
        root = Path(__file__).resolve().parents[2]

        def git(*args: str) -> str:
            out = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
            )
            return out.stdout.strip()

        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return rev + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render(results: list[Result], command: str, elapsed: float) -> str:
    from importlib.metadata import version

    from tandem.testing.model_zoo import HELPERS

    results = sorted(results, key=lambda r: r.model_type.lower())
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    text_types = len(results) - counts["not a text model"]
    today = datetime.date.today().isoformat()
    lines = [
        "# Model support",
        "",
        f"Generated on {today} by `{command}` ({elapsed / 60:.1f} min), with mlx-lm "
        f"{version('mlx-lm')}, mlx {version('mlx')} and Tandem at {_tandem_revision()}.",
        "",
        "Each model type of mlx-lm's `mlx_lm/models/` is written as a tiny random-weight "
        "float32 model (`tandem/testing/model_zoo.py`: hidden size 64, 2-4 layers with one "
        "of each layer kind, 4 experts, sliding windows of 8 tokens). Tandem "
        f"(`LLM(path, {', '.join(f'{k}={v}' for k, v in ENGINE_OPTIONS.items())})`, greedy, "
        f"{MAX_TOKENS} tokens) must reproduce mlx-lm's `generate_step` token for token on a "
        f"{PROMPT_LEN}-token prompt and on {len(BATCH_LENS)} staggered prompts of "
        f"{', '.join(map(str, BATCH_LENS))} tokens. `refused`: Tandem declined it at load "
        "(its message); `fails`: it loaded but crashed or diverged (where); "
        "`no tiny config`: the tool could not build or run a tiny model of it with mlx-lm "
        "itself. Multimodal wrappers (a `text_config` inside: `gemma3`, `mistral3`, "
        "`qwen3_vl`, ...) run as mlx-lm loads them, their language model on token ids.",
        "",
        f"**{counts['supported']} of {text_types} text model types supported** "
        f"({counts['refused']} refused, {counts['fails']} fail, "
        f"{counts['no tiny config']} without a tiny config"
        + (f"; {counts['not a text model']} not text models" if counts["not a text model"] else "")
        + ").",
        "",
        "| model_type | status | details |",
        "|---|---|---|",
    ]
    for r in results:
        lines.append(f"| `{r.model_type}` | {r.status} | {_cell(r.detail)} |")
    helpers = ", ".join(f"`{h}`" for h in sorted(HELPERS - {"__init__"}))
    lines += ["", f"Helper modules of `mlx_lm/models/`, not model types: {helpers}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/models.md"))
    ap.add_argument("--types", help="comma-separated model types (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="types run at once")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per type")
    ap.add_argument("--mlx-only", action="store_true", help="check the mlx-lm side only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.mlx_only)
    from tandem.testing.model_zoo import model_types

    types = args.types.split(",") if args.types else model_types()
    command = "python -m tandem.bench.models --out " + str(args.out)
    if args.types:
        command += f" --types {args.types}"
    start = time.monotonic()
    results: list[Result] = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(run_isolated, t, args.timeout, args.mlx_only) for t in types]
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            results.append(r)
            print(
                f"[{len(results):3d}/{len(types)}] {r.model_type:24s} {r.status:16s} "
                f"{r.seconds:5.1f}s  {r.detail}",
                flush=True,
            )
    elapsed = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, command, elapsed), encoding="utf-8")
    counts = {s: sum(r.status == s for r in results) for s in (*STATUSES, "mlx-lm only")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"{summary}; wrote {args.out} in {elapsed:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
