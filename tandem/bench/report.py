"""One command per machine for the benchmark summary: ``tandem bench report --machine cpu``
(or ``gpu``) runs a fixed list of benchmarks, each as its own process writing JSON under
``--out``, then renders ``--out``/README.md from every JSON there, with the commit, the
machine and the command of each row.

On the device machine a call may not run the whole list (10 minutes a call): ``--only
NAME,...`` runs some entries and renders what is there; a later call runs the rest into the
same folder (carried back between calls), and ``--render`` only renders. Entries whose JSON
exists are skipped unless ``--again``.

The summary is the headline numbers (Tandem against mlx-lm and the plain-loop ceiling, in
one process; speculation against none); docs/benchmarks.md keeps the narrative, and links
each machine's summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench import provenance


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "offline" | "speculative": which renderer reads its JSON
    title: str
    argv: tuple[str, ...]  # after ``python -m tandem.cli bench``
    model: str | None = None  # a bench shape written first (``models_dir``; --model DIR)
    dtype: str = "float32"


def _offline(
    shape: str, title: str, batches: str, lengths: tuple[int, int, int], reps: int, dtype: str
) -> Entry:
    """Tandem vs mlx-lm and the ceiling on a bench shape; ``lengths``: input, output and
    single-stream tokens."""
    i, o, single = (str(n) for n in lengths)
    argv = (
        "offline",
        *("--shape", shape, "--dtype", dtype, "--batch-sizes", batches),
        *("--input-len", i, "--output-len", o, "--single-tokens", single),
        *("--repeats", str(reps), "--overlap-batch", "0", "--ceiling"),
    )
    return Entry(f"offline-{shape.replace('smollm2-135m', 'smollm2')}", "offline", title, argv)


def _ngram(title: str, max_tokens: int, reps: int) -> Entry:
    """n-gram speculation against none on the default model (its copy and random loads)."""
    argv = ("speculative", "--num-tokens", "4", "--streams", "1,4")
    argv += ("--max-tokens", str(max_tokens), "--repeats", str(reps))
    return Entry("spec-ngram", "speculative", title, argv)


def _hybrid(title: str, shape: str, max_tokens: int, reps: int, weights: str) -> Entry:
    """Speculation on a hybrid shape with the oracle's proposals half wrong, in float32
    (so the oracle's text stays the model's: runner/positions.py, docs/benchmarks.md)."""
    argv = ("speculative", "--num-tokens", "4", "--workloads", "random", "--streams", "1,4")
    argv += ("--prompt-tokens", "256", "--max-tokens", str(max_tokens))
    argv += ("--repeats", str(reps), "--dtype", "float32", "--oracle", "0.5")
    return Entry("spec-hybrid", "speculative", title, argv, model=shape, dtype=weights)


PROFILES: dict[str, tuple[Entry, ...]] = {
    "cpu": (
        _offline(
            "smollm2-135m", "SmolLM2-135M shape, float32", "16,64", (128, 128, 64), 3, "float32"
        ),
        _offline(
            "tiny", "tiny llama (host-bound), float32", "16,64", (256, 256, 256), 3, "float32"
        ),
        _offline(
            "qwen3.5-tiny",
            "Qwen3.5 hybrid, tiny width, float32",
            "16,64",
            (128, 64, 64),
            2,
            "float32",
        ),
        _offline(
            "gemma3-tiny",
            "Gemma 3 layer pattern (windows of 512, a global layer every 6th), tiny width, float32",
            "16,64",
            (640, 64, 64),
            2,
            "float32",
        ),
        _ngram("n-gram speculation, the default model (float32)", 256, 2),
        _hybrid(
            "Qwen3.5 hybrid tiny, oracle proposals half wrong", "qwen3.5-tiny", 128, 3, "float32"
        ),
    ),
    "gpu": (
        _offline(
            "qwen3-0.6b", "Qwen3-0.6B shape, bf16", "16,64,256", (256, 256, 256), 3, "bfloat16"
        ),
        _offline("qwen3-8b", "Qwen3-8B shape, bf16", "16,64", (128, 128, 128), 2, "bfloat16"),
        _offline(
            "qwen3.5-2b", "Qwen3.5 ~2B hybrid shape, bf16", "16,64", (256, 128, 128), 2, "bfloat16"
        ),
        _offline(
            "gemma3-1b",
            "Gemma 3 1B shape (sliding windows), bf16",
            "16,64",
            (256, 128, 128),
            2,
            "bfloat16",
        ),
        _ngram("n-gram speculation, the default model (its 4-bit GGUF)", 256, 3),
        _hybrid(
            "Qwen3.5 ~2B hybrid, oracle proposals half wrong (float32 compute)",
            "qwen3.5-2b",
            64,
            2,
            "bfloat16",
        ),
    ),
}


def models_dir(entry: Entry) -> Path:
    """Where an entry's random-weight model is written (the model cache, not ``--out``)."""
    from tandem.model_source import cache_dir

    return cache_dir() / "bench-models" / entry.dtype


def command(entry: Entry, out: Path, models: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "tandem.cli", "bench", *entry.argv]
    if entry.model is not None:
        argv += ["--model", str((models or models_dir(entry)) / entry.model)]
    return [*argv, "--json", str(out / f"{entry.name}.json")]


def run_entry(entry: Entry, out: Path, timeout: float) -> dict[str, Any]:
    """Run one benchmark in a process of its own; its log beside its JSON."""
    if entry.model is not None and not (models_dir(entry) / entry.model).exists():
        from tandem.bench.shapes import make_model

        make_model(entry.model, entry.dtype, models_dir(entry))
    argv = command(entry, out)
    t = time.perf_counter()
    with open(out / f"{entry.name}.log", "w") as log:
        try:
            rc = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"name": entry.name, "rc": rc, "seconds": round(time.perf_counter() - t, 1)}


def _fmt(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def _failed(error: str | None) -> str:
    """A failed side's cell: out of memory, or that it failed (its error is in the JSON)."""
    if not error:
        return ""
    return "out of memory" if "out of memory" in error else "failed"


def render_offline(d: dict[str, Any]) -> list[str]:
    rows = [
        "| | mlx-lm tok/s | Tandem tok/s | ratio | ceiling tok/s | of ceiling | overlap on/off |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ["single"] + sorted(
        (k for k in d if k.startswith("batch_")), key=lambda k: int(k.split("_")[1])
    )
    for key in keys:
        if key not in d:
            continue
        r = d[key]
        label = "single stream" if key == "single" else f"B = {key.split('_')[1]}"
        ratio = r.get("ratio_vs_mlx_lm")
        mlx = _fmt(r.get("mlx_lm_tok_s")) or _failed(r.get("mlx_lm_error"))
        rows.append(
            f"| {label} | {mlx} | {_fmt(r.get('tandem_tok_s'))} "
            f"| {'' if ratio is None else f'**{ratio:,.2f}**'} "
            f"| {_fmt(r.get('ceiling_tok_s')) or _failed(r.get('ceiling_error'))} "
            f"| {_fmt(r.get('of_ceiling'), 2)} | {_fmt(r.get('overlap_on_off'), 2)} |"
        )
    return rows


def render_speculative(d: dict[str, Any]) -> list[str]:
    rows = [
        "| workload | streams | K | tok/s | vs off | accepted | per verify | back-offs "
        "| same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in d.get("rows", []):
        acc = r.get("acceptance")
        same = "yes" if r.get("exact", True) else f"differ from token {r.get('first_diff')}"
        offs = r.get("backoffs", "")
        if r.get("resumes"):
            offs = f"{offs} ({r['resumes']} ended early)"
        rows.append(
            f"| {r['workload']} | {r['streams']} | {r['spec_tokens'] or 'off'} "
            f"| {_fmt(r['tok_s'])} | **{_fmt(r.get('ratio'), 2)}** "
            f"| {'' if acc is None else f'{acc:.0%}'} "
            f"| {_fmt(r.get('mean_accepted_per_verify'), 2)} | {offs} | {same} |"
        )
    return rows


RENDER = {"offline": render_offline, "speculative": render_speculative}


def _commit(env: dict[str, Any]) -> str:
    tandem = env.get("tandem") or {}
    dirty = " (dirty)" if tandem.get("dirty") else ""
    return (tandem.get("git_commit") or "unknown")[:12] + dirty


def render(machine: str, out: Path, runs: list[dict[str, Any]] | None = None) -> str:
    """The summary of every JSON in ``out``; its machine and versions are those its entries
    ran on (``environment.json``, written by the last call that ran one), not the renderer's:
    entries of one folder are meant to come from one machine (rerun them all, ``--again``,
    after it changes). Where they come from several commits (``--only``), each table names
    its own."""
    saved = out / "environment.json"
    env = json.loads(saved.read_text()) if saved.exists() else provenance.environment()
    commits = env.get("entry_commits") or {}
    mixed = len(set(commits.values())) > 1
    at = f"Commit `{_commit(env)}`"
    if mixed:
        at = f"Commits per table (the latest run at `{_commit(env)}`)"
    where = env.get("gpu") or f"{env.get('platform')}, {env.get('cpu_count')} CPUs"
    lines = [
        f"# Benchmark summary: {machine}",
        "",
        f"{at}, {env.get('date') or time.strftime('%Y-%m-%d')}; {where}",
        "",
        f"Made by `tandem bench report --machine {machine} --out {out}` (tandem/bench/report.py);",
        "each table's command is under it, its JSON and log beside this file.",
    ]
    versions = env.get("versions") or {}
    if versions:
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))]
    for entry in PROFILES[machine]:
        path = out / f"{entry.name}.json"
        lines += ["", f"## {entry.title}", ""]
        if not path.exists():
            lines.append("(not run)")
            continue
        lines += RENDER[entry.kind](json.loads(path.read_text()))
        shown = command(entry, Path("OUT"), Path("MODELS"))[3:]
        lines += ["", "    " + " ".join(["tandem", *shown])]
        if mixed:
            lines += ["", f"At `{commits.get(entry.name, 'unknown')}`."]
    if runs:
        lines += ["", "## This run", "", "| entry | exit | seconds |", "|---|---|---:|"]
        lines += [f"| {r['name']} | {r['rc']} | {r['seconds']} |" for r in runs]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--machine", choices=sorted(PROFILES), required=True)
    p.add_argument("--out", required=True, help="folder of the JSONs, logs and README.md")
    p.add_argument("--only", help="comma-separated entry names (default: all)")
    p.add_argument("--again", action="store_true", help="rerun entries whose JSON exists")
    p.add_argument("--render", action="store_true", help="only render README.md")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per entry")


def _environment(out: Path, names: set[str]) -> dict[str, Any]:
    """This run's environment, with the commits of the entries it keeps from earlier runs
    (those of an ``environment.json`` from before they were recorded: its own commit)."""
    saved = out / "environment.json"
    old = json.loads(saved.read_text()) if saved.exists() else {}
    commits = dict(old.get("entry_commits") or {})
    for name in sorted(names):
        if old and name not in commits and (out / f"{name}.json").exists():
            commits[name] = _commit(old)
    return {**provenance.environment(), "date": time.strftime("%Y-%m-%d"), "entry_commits": commits}


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = PROFILES[args.machine]
    names = {e.name for e in entries}
    only = set(args.only.split(",")) if args.only else names
    unknown = only - names
    if unknown:
        print(f"unknown entries {sorted(unknown)}; {args.machine} has {sorted(names)}")
        return 2
    runs: list[dict[str, Any]] = []
    env: dict[str, Any] | None = None
    if not args.render:
        for entry in entries:
            if entry.name not in only:
                continue
            if (out / f"{entry.name}.json").exists() and not args.again:
                continue
            print(f"== {entry.name}", flush=True)
            if env is None:
                env = _environment(out, names)
            env["entry_commits"][entry.name] = _commit(env)
            (out / "environment.json").write_text(json.dumps(env, indent=2))
            runs.append(run_entry(entry, out, args.timeout))
            print(f"   {runs[-1]}", flush=True)
    (out / "README.md").write_text(render(args.machine, out, runs))
    print(f"wrote {out / 'README.md'}")
    return 0 if all(r["rc"] == 0 for r in runs) else 1
